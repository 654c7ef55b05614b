//! Reading a SQLite write-ahead log the way SQLite's recovery does, to tell when recovery will
//! drop committed transactions.
//!
//! On opening, SQLite replays the WAL's frames in order and stops at the first one whose salts
//! or running checksum do not match (the format: <https://www.sqlite.org/fileformat.html>,
//! "WAL file format"). A torn or overwritten frame in the middle therefore silently discards
//! every frame after it, committed or not. This module walks the same chain and also counts
//! the frames of the current generation (matching salts) that lie beyond the break: if there
//! are any, recovery will lose them, and the store keeps copies and says so before opening.

/// What a WAL holds, as SQLite's recovery will read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalCheck {
    /// Frames SQLite will replay (up to the last valid commit frame).
    pub recovered_frames: usize,
    /// Frames of the current generation after the first broken one: recovery drops them.
    pub lost_frames: usize,
}

const HEADER: usize = 32;
const FRAME_HEADER: usize = 24;

/// `None` when `bytes` is not a WAL (too short, wrong magic, an impossible page size).
pub fn check(bytes: &[u8]) -> Option<WalCheck> {
    if bytes.len() < HEADER {
        return None;
    }
    let magic = be(&bytes[0..4]);
    if magic & !1 != 0x377f_0682 {
        return None;
    }
    let big_endian = magic & 1 == 1;
    let page = be(&bytes[8..12]) as usize;
    if !(512..=65_536).contains(&page) || !page.is_power_of_two() {
        return None;
    }
    let salts = &bytes[16..24];
    let mut sums = checksum((0, 0), &bytes[..24], big_endian);
    if sums != (be(&bytes[24..28]), be(&bytes[28..32])) {
        // A broken header: SQLite ignores the whole log.
        sums = (u32::MAX, u32::MAX);
    }
    let frame = FRAME_HEADER + page;
    let (mut recovered, mut lost, mut broken) = (0, 0, sums == (u32::MAX, u32::MAX));
    for (index, frame) in bytes[HEADER..].chunks_exact(frame).enumerate() {
        let ours = &frame[8..16] == salts;
        if broken {
            lost += usize::from(ours);
            continue;
        }
        let next = checksum(
            checksum(sums, &frame[..8], big_endian),
            &frame[FRAME_HEADER..],
            big_endian,
        );
        if !ours || next != (be(&frame[16..20]), be(&frame[20..24])) {
            broken = true;
            lost += usize::from(ours);
            continue;
        }
        sums = next;
        // A commit frame (it records the database size) ends a transaction: recovery keeps
        // the valid chain up to the last one.
        if be(&frame[4..8]) != 0 {
            recovered = index + 1;
        }
    }
    Some(WalCheck {
        recovered_frames: recovered,
        lost_frames: lost,
    })
}

fn be(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// SQLite's WAL checksum over `data` (a multiple of 8 bytes), continuing from `(s0, s1)`.
fn checksum((mut s0, mut s1): (u32, u32), data: &[u8], big_endian: bool) -> (u32, u32) {
    let word = |b: &[u8]| {
        let b = [b[0], b[1], b[2], b[3]];
        if big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    };
    for pair in data.chunks_exact(8) {
        s0 = s0.wrapping_add(word(&pair[..4])).wrapping_add(s1);
        s1 = s1.wrapping_add(word(&pair[4..])).wrapping_add(s0);
    }
    (s0, s1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real WAL: twenty committed inserts with checkpoints off, read while the connection
    /// holds it.
    fn wal_of_twenty_commits(dir: &std::path::Path) -> (rusqlite::Connection, Vec<u8>) {
        let path = dir.join("t.sqlite3");
        let connection = rusqlite::Connection::open(&path).unwrap();
        connection
            .pragma_update(None, "journal_mode", "WAL")
            .unwrap();
        connection
            .pragma_update(None, "wal_autocheckpoint", 0)
            .unwrap();
        connection.execute_batch("CREATE TABLE t (x TEXT)").unwrap();
        for i in 0..20 {
            connection
                .execute("INSERT INTO t VALUES (?1)", [format!("{i:0>900}")])
                .unwrap();
        }
        let bytes = std::fs::read(dir.join("t.sqlite3-wal")).unwrap();
        (connection, bytes)
    }

    #[test]
    fn an_intact_log_loses_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (_connection, bytes) = wal_of_twenty_commits(dir.path());
        let checked = check(&bytes).unwrap();
        assert!(checked.recovered_frames >= 20, "{checked:?}");
        assert_eq!(checked.lost_frames, 0);
    }

    #[test]
    fn garbage_in_a_middle_frame_shows_the_frames_recovery_drops() {
        let dir = tempfile::tempdir().unwrap();
        let (_connection, mut bytes) = wal_of_twenty_commits(dir.path());
        let page = be(&bytes[8..12]) as usize;
        let third = HEADER + 2 * (FRAME_HEADER + page) + FRAME_HEADER + 100;
        bytes[third] ^= 0xff;
        let checked = check(&bytes).unwrap();
        assert_eq!(checked.recovered_frames, 2, "{checked:?}");
        assert!(checked.lost_frames >= 18, "{checked:?}");
    }

    #[test]
    fn what_is_not_a_log_is_said_so() {
        assert_eq!(check(b"short"), None);
        assert_eq!(check(&[0u8; 64]), None);
    }
}
