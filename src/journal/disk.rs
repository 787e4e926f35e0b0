//! The journal's files, behind a small trait so that tests can make a disk
//! fill up, fail a sync or stall one ([`faulty`]).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// Where segment files are made and removed.
pub trait Disk: Send + Sync + std::fmt::Debug + 'static {
    /// Creates a new, empty segment file at `path` and makes its name
    /// durable (the directory is synced).
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>>;

    fn remove(&self, path: &Path) -> io::Result<()>;
}

/// A segment being appended to.
pub trait SegmentFile: Send + std::fmt::Debug {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()>;

    /// Makes what was written durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;

    /// Cuts the file back to `len` bytes, durably.
    fn truncate(&mut self, len: u64) -> io::Result<()>;
}

/// The real file system.
#[derive(Debug, Default)]
pub struct Fs;

impl Disk for Fs {
    fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new().write(true).create_new(true).open(path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(Box::new(FsFile(file)))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
}

#[derive(Debug)]
struct FsFile(File);

impl SegmentFile for FsFile {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.write_all(bytes)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        // `fdatasync` covers the size: it is needed to read the data back.
        self.0.set_len(len)?;
        self.0.sync_data()
    }
}

#[cfg(any(test, feature = "test-support"))]
pub mod faulty {
    //! A [`Disk`] over the real one that fails or stalls on command.

    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar, Mutex};

    use super::*;

    #[derive(Debug, Default)]
    pub struct FaultyDisk {
        faults: Arc<Faults>,
    }

    /// What the disk does wrong now; shared with its files.
    #[derive(Debug, Default)]
    pub struct Faults {
        /// Writes fail as a full disk's do.
        pub full: AtomicBool,
        /// Syncs fail with an I/O error.
        pub failing_syncs: AtomicBool,
        /// Syncs wait while this is true.
        held: Mutex<bool>,
        released: Condvar,
        /// Syncs that succeeded.
        pub syncs: AtomicUsize,
    }

    impl Faults {
        /// Makes every sync wait until [`Faults::release`].
        pub fn hold(&self) {
            *self.held.lock().unwrap_or_else(|p| p.into_inner()) = true;
        }

        pub fn release(&self) {
            *self.held.lock().unwrap_or_else(|p| p.into_inner()) = false;
            self.released.notify_all();
        }

        fn wait_released(&self) {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            while *held {
                held = self.released.wait(held).unwrap_or_else(|p| p.into_inner());
            }
        }
    }

    impl FaultyDisk {
        pub fn faults(&self) -> Arc<Faults> {
            self.faults.clone()
        }
    }

    impl Disk for FaultyDisk {
        fn create(&self, path: &Path) -> io::Result<Box<dyn SegmentFile>> {
            if self.faults.full.load(Ordering::SeqCst) {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    "no space left (injected)",
                ));
            }
            let inner = Fs.create(path)?;
            Ok(Box::new(FaultyFile {
                inner,
                faults: self.faults.clone(),
            }))
        }

        fn remove(&self, path: &Path) -> io::Result<()> {
            Fs.remove(path)
        }
    }

    #[derive(Debug)]
    struct FaultyFile {
        inner: Box<dyn SegmentFile>,
        faults: Arc<Faults>,
    }

    impl SegmentFile for FaultyFile {
        fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
            if self.faults.full.load(Ordering::SeqCst) {
                // A full disk takes part of a write, as a real one may.
                let _ = self.inner.write_all(&bytes[..bytes.len() / 2]);
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    "no space left (injected)",
                ));
            }
            self.inner.write_all(bytes)
        }

        fn sync(&mut self) -> io::Result<()> {
            self.faults.wait_released();
            if self.faults.failing_syncs.load(Ordering::SeqCst) {
                return Err(io::Error::other("fsync failed (injected)"));
            }
            self.inner.sync()?;
            self.faults.syncs.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }

        /// A full disk still shrinks a file; a failing sync fails this
        /// too, leaving the file as it was.
        fn truncate(&mut self, len: u64) -> io::Result<()> {
            self.faults.wait_released();
            if self.faults.failing_syncs.load(Ordering::SeqCst) {
                return Err(io::Error::other("fsync failed (injected)"));
            }
            self.inner.truncate(len)
        }
    }
}
