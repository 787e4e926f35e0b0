//! A shard's unwritten changes, journaled again: a fleet node's new backup
//! must hold every change the store lacks, not only those journaled after
//! it attached (see `crate::cluster::backup`).

use super::{Flags, Shard};
use crate::journal::{Journal, record};

impl Shard {
    /// Journals every user with changes the store may lack (cached,
    /// evicted, being written, or replayed and not loaded) as one entry of
    /// all of them; returns how many.
    pub(crate) fn rejournal(&self, journal: &Journal, now_ms: u64) -> usize {
        let unwritten: Vec<u64> = (self.users.iter())
            .filter(|u| u.has_unwritten() || u.is(Flags::IN_FLIGHT))
            .map(|u| u.user_id)
            .collect();
        for &user_id in &unwritten {
            let Some(slot) = self.users.find(user_id) else {
                continue;
            };
            let view = self.view(slot);
            let lowered = self.deletions.of_user(user_id, now_ms);
            journal.append(|out| {
                record::append_user(out, user_id, view.written_version(), view);
                if !lowered.is_empty() {
                    record::append_lowered(out, user_id, &lowered);
                }
            });
        }
        let mut replayed = 0;
        for write in self.replayed_writes() {
            journal.append(|out| record::append_write(out, write));
            replayed += 1;
        }
        unwritten.len() + replayed
    }
}
