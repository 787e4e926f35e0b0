//! The journal directory's lock: one process at a time journals into a
//! directory, as PostgreSQL's `postmaster.pid` keeps one server on a data
//! directory.
//!
//! A second process on a live node's directory (a compose file run twice,
//! one `--node-id` on a shared volume) replayed the live one's segments,
//! wrote them and deleted them, the open one included (issue 53). So the
//! journal takes an exclusive `flock` on [`LOCK_FILE`] in its directory
//! before it reads anything, and writes who holds it into the file for the
//! next one to name. The kernel drops the lock with the process, however it
//! ends (kill -9 too): a restart in place takes it at once. A held
//! [`DirLock`] therefore also says that no earlier process of this node on
//! this machine still has the journal open.
//!
//! A fleet node also writes the incarnation holding its lease (only with
//! the journal synced before every answer), with the kernel's boot id and
//! the lock file's device and inode: the next start reads it as its
//! [`DirLock::predecessor`], gone for certain only if it locked this very
//! file under this very kernel (a copy of the directory, a volume cloned or
//! moved to another machine, proves nothing of the process on the
//! original), whose lease it may take back at once (`docs/failover.md`,
//! "Restarted in place").

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::JournalError;

/// The lock file, in the journal's directory. Never deleted: a process
/// that unlinked it on its way out could leave the next two each holding a
/// lock, one on the unlinked file and one on a new one.
pub const LOCK_FILE: &str = "readstates.lock";

/// An exclusive lock on a journal directory, held until dropped.
#[derive(Debug)]
pub struct DirLock {
    dir: PathBuf,
    holder: Holder,
    /// What the file named when this process took the lock: the last
    /// process that held it.
    previous: Option<Holder>,
    /// The lock is this open file's (its open file description's): closing
    /// it releases the lock.
    _file: File,
}

/// Who holds a directory: written into [`LOCK_FILE`] once locked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    pub host: String,
    /// When it took the lock (RFC 3339), which is during its start.
    pub started: String,
    /// The fleet node's incarnation (its lease names it), once recorded,
    /// with where its lock was: the kernel's boot id and the lock file's
    /// `device:inode`.
    pub incarnation: Option<String>,
    pub boot: Option<String>,
    pub file: Option<String>,
}

impl DirLock {
    /// Locks `dir` (made if missing) or fails at once with
    /// [`JournalError::Locked`], naming the holder.
    pub fn acquire(dir: &Path) -> Result<DirLock, JournalError> {
        std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, &e))?;
        let path = dir.join(LOCK_FILE);
        // Not truncated on open: until it is ours, it names the holder.
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| JournalError::io(&path, &e))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut written = String::new();
                // Empty if the holder has locked but not written yet.
                let _ = file.read_to_string(&mut written);
                let holder = Holder::parse(&written)
                    .map_or_else(|| "which did not say who it is".into(), |h| h.to_string());
                return Err(JournalError::Locked {
                    dir: dir.to_owned(),
                    holder,
                });
            }
            // A file system without locks (some network ones): refused
            // rather than run unguarded.
            Err(TryLockError::Error(e)) => return Err(JournalError::io(&path, &e)),
        }
        let mut written = String::new();
        // Unreadable or empty: no predecessor is named.
        let _ = file.read_to_string(&mut written);
        let previous = Holder::parse(&written);
        let lock = DirLock {
            dir: dir.to_owned(),
            holder: Holder::this_process(),
            previous,
            _file: file,
        };
        lock.write()?;
        Ok(lock)
    }

    /// Writes who holds it into the file: only what the next one reads (in
    /// its error, or as its predecessor). Synced, since a restart in place
    /// trusts the incarnation named.
    fn write(&self) -> Result<(), JournalError> {
        let path = self.dir.join(LOCK_FILE);
        let mut file = &self._file;
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(self.holder.encode().as_bytes()))
            .and_then(|()| file.sync_data())
            .map_err(|e| JournalError::io(&path, &e))
    }

    /// Names `incarnation` as this process's in the file, with this
    /// kernel's boot id and the file's identity, for the next start to
    /// find as its predecessor's.
    pub fn record_incarnation(&mut self, incarnation: &str) -> Result<(), JournalError> {
        self.holder.incarnation = Some(incarnation.to_owned());
        self.holder.boot = boot_id();
        self.holder.file = self.identity();
        self.write()
    }

    /// The last process that held the directory before this one.
    pub fn predecessor(&self) -> Option<&Holder> {
        self.previous.as_ref()
    }

    /// The incarnation the predecessor recorded, only if it locked this
    /// very file under this very kernel: then the kernel let go of its
    /// lock, so it is gone. A copy of the directory (another inode), or
    /// one on another machine or after a reboot (another boot id), names
    /// a process this lock says nothing about.
    pub fn gone_predecessor(&self) -> Option<&str> {
        let previous = self.previous.as_ref()?;
        let here = (boot_id(), self.identity());
        let known = here.0.is_some() && here.1.is_some();
        (known && (previous.boot.clone(), previous.file.clone()) == here)
            .then_some(previous.incarnation.as_deref())
            .flatten()
    }

    /// The lock file's `device:inode`.
    fn identity(&self) -> Option<String> {
        use std::os::unix::fs::MetadataExt;
        let metadata = self._file.metadata().ok()?;
        Some(format!("{}:{}", metadata.dev(), metadata.ino()))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// This process, as written into the lock file.
    pub fn holder(&self) -> &Holder {
        &self.holder
    }
}

impl Holder {
    fn this_process() -> Holder {
        Holder {
            pid: std::process::id(),
            host: hostname(),
            started: humantime::format_rfc3339_seconds(SystemTime::now()).to_string(),
            incarnation: None,
            boot: None,
            file: None,
        }
    }

    /// One `key value` line each.
    fn encode(&self) -> String {
        let mut text = format!(
            "pid {}\nhost {}\nstarted {}\n",
            self.pid, self.host, self.started
        );
        let recorded = [
            ("incarnation", &self.incarnation),
            ("boot", &self.boot),
            ("file", &self.file),
        ];
        for (key, value) in recorded {
            if let Some(value) = value {
                text.push_str(&format!("{key} {value}\n"));
            }
        }
        text
    }

    fn parse(text: &str) -> Option<Holder> {
        let value = |key: &str| {
            (text.lines())
                .find_map(|line| line.strip_prefix(key)?.strip_prefix(' '))
                .map(str::to_owned)
        };
        Some(Holder {
            pid: value("pid")?.parse().ok()?,
            host: value("host")?,
            started: value("started")?,
            incarnation: value("incarnation"),
            boot: value("boot"),
            file: value("file"),
        })
    }
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pid {} on host {}, started {}",
            self.pid, self.host, self.started
        )
    }
}

/// This boot of the kernel (Linux): the same for every process and
/// container on the machine until it restarts.
fn boot_id() -> Option<String> {
    let id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(id.trim().to_owned()).filter(|id| !id.is_empty())
}

/// The kernel's name for this host (what `hostname` prints; a container's
/// own unless it shares the host's).
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests;
