//! Where observations are kept: SQLite (one file under `--data-dir`, WAL) or PostgreSQL
//! (`--database-url postgres://...`, shared by any number of replicas).
//!
//! Crates: `rusqlite` (bundled SQLite, so no system library is needed) and the synchronous
//! `postgres` client (tokio-postgres underneath). Both are small, well kept and synchronous,
//! which suits the store: every call runs on the blocking pool (`spawn_blocking`) as the
//! profile files did, and the estimate hot path never touches the database (profiles are
//! derived into memory). sqlx would serve both too, but brings an async pool, macros and a
//! much larger dependency tree for four statements.
//!
//! Schema migrations are versioned ([`MIGRATIONS`]) and applied at start in one transaction
//! (on PostgreSQL under an advisory lock, so replicas starting together do not race); a
//! database newer than this build is refused.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where an observation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `POST /v1/calibration/observations`.
    Posted,
    /// A process watched through `POST /v1/calibration/watch`.
    Watched,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Posted => "posted",
            Source::Watched => "watched",
        }
    }

    fn parse(s: &str) -> Source {
        match s {
            "watched" => Source::Watched,
            _ => Source::Posted,
        }
    }
}

/// An observation to be stored.
#[derive(Debug, Clone, PartialEq)]
pub struct NewObservation {
    /// Profile key of the GPU.
    pub gpu: String,
    pub environment: Option<String>,
    /// The job description as posted (JSON text).
    pub job: String,
    pub observed_peak_mib: f64,
    /// The uncalibrated figure the service predicted for the job when it was observed.
    pub predicted_mib: f64,
    /// The predicted figure by category (JSON object, MiB: parameters, gradients, ...).
    pub breakdown: String,
    pub source: Source,
    /// The step time measured, ms, and the job's predicted step times across host costs
    /// (JSON `[[host_us, ms], ...]`, [`super::step_time::curve`]); both or neither.
    pub step_time: Option<(f64, String)>,
}

/// What a profile is derived from: one stored observation without its job description.
#[derive(Debug, Clone, PartialEq)]
pub struct FitRow {
    pub id: i64,
    /// Observations recorded by one call share a batch.
    pub batch_id: i64,
    pub recorded_at: i64,
    pub gpu: String,
    pub environment: Option<String>,
    pub observed_peak_mib: f64,
    pub predicted_mib: f64,
    /// JSON object of the predicted breakdown, MiB.
    pub breakdown: String,
    /// The step time measured and the job's curve, where the observation had one.
    pub step_time: Option<(f64, String)>,
}

/// A stored observation as exported (`gpucast observations export`): one JSON line each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedObservation {
    pub id: i64,
    /// RFC 3339, UTC.
    pub recorded_at: String,
    pub gpu: String,
    pub environment: Option<String>,
    pub job: serde_json::Value,
    pub observed_peak_mib: f64,
    pub predicted_mib: f64,
    pub breakdown: serde_json::Value,
    pub source: Source,
    /// The step time measured, ms, where the observation had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time_ms: Option<f64>,
}

/// How many observations are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Per GPU and environment: the newest are kept.
    pub per_key: usize,
    /// In all: the oldest go first.
    pub total: usize,
    /// Bytes of the stored texts (job, breakdown, step-time curve) in all: the oldest go
    /// first. A job is stored as posted, up to the body limit, so rows alone do not bound
    /// the store.
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("sqlite {path}: {source}")]
    Sqlite {
        path: PathBuf,
        source: rusqlite::Error,
    },
    #[error("postgres: {0}")]
    Postgres(#[from] postgres::Error),
    /// The data directory cannot be made.
    #[error("{path}: {source}")]
    DataDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Other(String),
    /// The SQLite file is not a sound database.
    #[error("damaged: {0}")]
    Damaged(String),
}

impl DbError {
    /// What a caller is told (in a 503's detail, in `/readyz`): the error without the store's
    /// filesystem paths, which say where the service keeps its data. The whole error goes to
    /// the log.
    pub fn for_callers(&self) -> String {
        match self {
            DbError::Sqlite { source, .. } => format!("sqlite: {source}"),
            DbError::DataDir { source, .. } => format!("data directory: {source}"),
            other => other.to_string(),
        }
    }
}

/// One version of the schema: its number and its statements for each backend.
pub struct Migration {
    pub version: i64,
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// Version 2, the same on both backends: an observation's step time and its curve.
const ADD_STEP_TIME: &str = "ALTER TABLE observations ADD COLUMN step_time_ms DOUBLE PRECISION;
    ALTER TABLE observations ADD COLUMN step_time_curve TEXT;";

/// Every schema version, oldest first. Never edit a released one: add the next.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sqlite: "CREATE TABLE observations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        recorded_at BIGINT NOT NULL,
        batch_id BIGINT NOT NULL,
        gpu TEXT NOT NULL,
        environment TEXT,
        job TEXT NOT NULL,
        observed_peak_mib DOUBLE PRECISION NOT NULL,
        predicted_mib DOUBLE PRECISION NOT NULL,
        breakdown TEXT NOT NULL,
        source TEXT NOT NULL
    );
    CREATE INDEX observations_by_key ON observations (gpu, environment, id);",
        postgres: "CREATE TABLE observations (
        id BIGSERIAL PRIMARY KEY,
        recorded_at BIGINT NOT NULL,
        batch_id BIGINT NOT NULL,
        gpu TEXT NOT NULL,
        environment TEXT,
        job TEXT NOT NULL,
        observed_peak_mib DOUBLE PRECISION NOT NULL,
        predicted_mib DOUBLE PRECISION NOT NULL,
        breakdown TEXT NOT NULL,
        source TEXT NOT NULL
    );
    CREATE INDEX observations_by_key ON observations (gpu, environment, id);",
    },
    Migration {
        version: 2,
        sqlite: ADD_STEP_TIME,
        postgres: ADD_STEP_TIME,
    },
    Migration {
        version: 3,
        sqlite: ADD_BYTES,
        postgres: ADD_BYTES,
    },
    Migration {
        version: 4,
        sqlite: "CREATE TABLE store_totals (
        one INTEGER PRIMARY KEY CHECK (one = 1),
        row_count BIGINT NOT NULL,
        byte_count BIGINT NOT NULL
    );
    INSERT INTO store_totals SELECT 1, COUNT(*), COALESCE(SUM(bytes), 0) FROM observations;
    CREATE TRIGGER observations_counted AFTER INSERT ON observations BEGIN
        UPDATE store_totals SET row_count = row_count + 1, byte_count = byte_count + NEW.bytes;
    END;
    CREATE TRIGGER observations_uncounted AFTER DELETE ON observations BEGIN
        UPDATE store_totals SET row_count = row_count - 1, byte_count = byte_count - OLD.bytes;
    END;",
        postgres: "CREATE TABLE store_totals (
        one INTEGER PRIMARY KEY CHECK (one = 1),
        row_count BIGINT NOT NULL,
        byte_count BIGINT NOT NULL
    );
    INSERT INTO store_totals SELECT 1, COUNT(*), COALESCE(SUM(bytes), 0) FROM observations;
    CREATE FUNCTION observations_count() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            UPDATE store_totals SET row_count = row_count + 1, byte_count = byte_count + NEW.bytes;
        ELSE
            UPDATE store_totals SET row_count = row_count - 1, byte_count = byte_count - OLD.bytes;
        END IF;
        RETURN NULL;
    END $$;
    CREATE TRIGGER observations_counted AFTER INSERT OR DELETE ON observations
        FOR EACH ROW EXECUTE FUNCTION observations_count();",
    },
];

/// Version 4 keeps the rows and bytes stored in `store_totals` (triggers on every insert and
/// delete), so that a write's retention and the store's fingerprint cost what they delete,
/// not a scan of the store.
const TOTALS: &str = "SELECT row_count, byte_count FROM store_totals";

/// How many rows the oldest-first walk of the byte retention reads at a time.
const TRIM_CHUNK: i64 = 256;

/// Each row's stored text bytes, so that retention in bytes sums a column instead of reading
/// every job. Rows of former versions count 0 until they age out.
const ADD_BYTES: &str = "ALTER TABLE observations ADD COLUMN bytes BIGINT NOT NULL DEFAULT 0;";

/// Key of the advisory lock that serialises migrations across replicas.
const MIGRATION_LOCK: i64 = 0x0067_7075_6361_7374;

/// Changes whenever rows are added or removed: (count, min id, max id).
pub type Fingerprint = (i64, i64, i64);

/// The observation database. Every method blocks: call from `spawn_blocking`.
pub trait ObservationDb: Send + Sync + std::fmt::Debug {
    /// Stores a batch in one transaction (all or nothing), then trims to `retention`.
    fn insert(&self, batch: &[NewObservation], retention: Retention) -> Result<(), DbError>;
    /// Changes whenever the stored rows do.
    fn fingerprint(&self) -> Result<Fingerprint, DbError>;
    /// Every row as profiles need it, oldest first.
    fn fit_rows(&self) -> Result<Vec<FitRow>, DbError>;
    /// One key's rows as profiles need them, oldest first (through the key's index: a write
    /// re-derives the keys it touched from these, not from the whole store).
    fn fit_rows_of(&self, gpu: &str, environment: Option<&str>) -> Result<Vec<FitRow>, DbError>;
    /// Every row with its job description, oldest first, handed to `each` one at a time.
    fn export(
        &self,
        each: &mut dyn FnMut(ExportedObservation) -> Result<(), DbError>,
    ) -> Result<(), DbError>;
    /// The schema version applied.
    fn schema_version(&self) -> Result<i64, DbError>;
    /// For logs: the file, or the server without credentials.
    fn describe(&self) -> String;
    /// What opening found wrong and repaired or set aside.
    fn startup_warnings(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Opens the database named by `database_url` (PostgreSQL) or else the SQLite file in
/// `data_dir`, applying migrations.
pub fn open(
    data_dir: &Path,
    database_url: Option<&str>,
) -> Result<Box<dyn ObservationDb>, DbError> {
    match database_url {
        Some(url) => Ok(Box::new(PostgresDb::open(url)?)),
        None => Ok(Box::new(SqliteDb::open(data_dir)?)),
    }
}

/// A batch id: unique enough across replicas (time, process, counter).
fn new_batch_id() -> i64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mixed = nanos
        ^ (u64::from(std::process::id()) << 40)
        ^ NEXT
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> 1) as i64
}

pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// A stored row's text column as JSON (`null` if it is not JSON).
/// A stored step time and its curve: both or neither.
/// The columns a [`FitRow`] is read from, in its order.
const FIT_COLUMNS: &str = "SELECT id, batch_id, recorded_at, gpu, environment, observed_peak_mib, predicted_mib, breakdown, step_time_ms, step_time_curve
     FROM observations";

fn step_time(ms: Option<f64>, curve: Option<String>) -> Option<(f64, String)> {
    ms.zip(curve)
}

fn json_or_null(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or(serde_json::Value::Null)
}

fn timestamp(unix: i64) -> String {
    super::profile::rfc3339(unix.max(0) as u64)
}

/// The SQLite file `<data_dir>/gpucast.sqlite3`, in WAL mode.
impl NewObservation {
    /// The bytes of its stored texts.
    fn stored_bytes(&self) -> i64 {
        (self.job.len() + self.breakdown.len() + self.step_time.as_ref().map_or(0, |s| s.1.len()))
            as i64
    }
}

/// The distinct (gpu, environment) keys of a batch.
fn keys(batch: &[NewObservation]) -> Vec<(String, Option<String>)> {
    let mut keys: Vec<(String, Option<String>)> = batch
        .iter()
        .map(|o| (o.gpu.clone(), o.environment.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

fn check_not_newer(current: i64) -> Result<(), String> {
    let latest = MIGRATIONS.last().map_or(0, |m| m.version);
    if current > latest {
        Err(format!(
            "the database's schema version {current} is newer than this build's ({latest}): upgrade gpucast"
        ))
    } else {
        Ok(())
    }
}

mod postgresql;
mod sqlite;

pub use postgresql::{redact, PostgresDb};
pub use sqlite::{SqliteDb, SQLITE_FILE};

#[cfg(test)]
mod tests {
    use super::sqlite::sidecar;
    use super::*;

    #[test]
    fn what_callers_are_told_names_no_path() {
        let secret = PathBuf::from("/srv/secret-data/gpucast");
        let errors = [
            DbError::Sqlite {
                path: secret.join(SQLITE_FILE),
                source: rusqlite::Error::InvalidQuery,
            },
            DbError::DataDir {
                path: secret.clone(),
                source: std::io::Error::other("read-only file system"),
            },
        ];
        for error in errors {
            assert!(
                error.to_string().contains("secret-data"),
                "the log keeps it"
            );
            let told = error.for_callers();
            assert!(!told.contains("secret-data"), "{told}");
        }
    }

    const DEFAULT_TEST_RETENTION: Retention = Retention {
        per_key: 1000,
        total: 1000,
        bytes: u64::MAX >> 1,
    };

    fn observation(gpu: &str, environment: Option<&str>, observed: f64) -> NewObservation {
        NewObservation {
            gpu: gpu.into(),
            environment: environment.map(str::to_string),
            job: "{\"batch_size\":1}".into(),
            observed_peak_mib: observed,
            predicted_mib: 1000.0,
            breakdown: "{}".into(),
            source: Source::Posted,
            step_time: None,
        }
    }

    /// A file that is not a database is set aside and a new store started, not a failed start.
    #[test]
    fn a_damaged_store_is_set_aside_and_a_new_one_started() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(SQLITE_FILE), vec![0x5a; 8192]).unwrap();
        let db = SqliteDb::open(dir.path()).unwrap();
        assert_eq!(db.fit_rows().unwrap().len(), 0);
        let warnings = db.startup_warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("moved to"), "{warnings:?}");
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("damaged-"))
            .collect();
        assert_eq!(aside.len(), 1);
        assert!(aside[0].path().join(SQLITE_FILE).exists());
    }

    /// Garbage in a middle frame of the log: the store starts with what SQLite recovers, and
    /// says how many frames recovery dropped, with copies of the files as found.
    #[test]
    fn a_log_that_recovery_would_cut_short_is_copied_and_reported() {
        let dir = tempfile::tempdir().unwrap();
        let wal = sidecar(&dir.path().join(SQLITE_FILE), "-wal");
        let saved = dir.path().join("saved");
        std::fs::create_dir_all(&saved).unwrap();
        {
            let db = SqliteDb::open(dir.path()).unwrap();
            db.with(|c| c.pragma_update(None, "wal_autocheckpoint", 0))
                .unwrap();
            for i in 0..20 {
                db.insert(
                    &[observation("t4", None, 1000.0 + i as f64)],
                    DEFAULT_TEST_RETENTION,
                )
                .unwrap();
            }
            // The files as a crash would leave them (the connection still open, no checkpoint).
            for suffix in ["", "-wal"] {
                let from = sidecar(&dir.path().join(SQLITE_FILE), suffix);
                std::fs::copy(&from, saved.join(from.file_name().unwrap())).unwrap();
            }
        }
        for suffix in ["", "-wal"] {
            let name = format!("{SQLITE_FILE}{suffix}");
            std::fs::copy(saved.join(&name), dir.path().join(&name)).unwrap();
        }
        let _ = std::fs::remove_file(sidecar(&dir.path().join(SQLITE_FILE), "-shm"));
        let mut bytes = std::fs::read(&wal).unwrap();
        let page = u32::from_be_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
        let middle = 32 + (bytes.len() - 32) / (24 + page) / 2 * (24 + page) + 24 + 100;
        bytes[middle] ^= 0xff;
        std::fs::write(&wal, &bytes).unwrap();

        let db = SqliteDb::open(dir.path()).unwrap();
        let warnings = db.startup_warnings();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("which SQLite's recovery drops"),
            "{warnings:?}"
        );
        let kept = db.fit_rows().unwrap().len();
        assert!(kept < 20, "recovery dropped rows: {kept}");
    }

    /// Rows of 1 MB jobs against a 3.5 MB store: the newest three stay, whatever their count.
    #[test]
    fn sqlite_keeps_the_newest_observations_within_the_byte_budget() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteDb::open(dir.path()).unwrap();
        let retention = Retention {
            per_key: 1000,
            total: 1000,
            bytes: 3_500_000,
        };
        for i in 0..6 {
            let big = NewObservation {
                job: format!("{{\"pad\":\"{}\"}}", "x".repeat(1_000_000)),
                ..observation("t4", None, 1000.0 + i as f64)
            };
            db.insert(&[big], retention).unwrap();
        }
        let kept: Vec<f64> = db
            .fit_rows()
            .unwrap()
            .iter()
            .map(|r| r.observed_peak_mib)
            .collect();
        assert_eq!(kept, vec![1003.0, 1004.0, 1005.0]);
        assert_totals_match(&db);
    }

    /// The totals the triggers keep are the table's.
    fn assert_totals_match(db: &SqliteDb) {
        db.with(|c| {
            let kept: (i64, i64) = c.query_row(TOTALS, [], |r| Ok((r.get(0)?, r.get(1)?)))?;
            let counted: (i64, i64) = c.query_row(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM observations",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            assert_eq!(kept, counted);
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn sqlite_is_in_wal_mode_migrated_once_and_keeps_rows_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let db = SqliteDb::open(dir.path()).unwrap();
        assert_eq!(
            db.schema_version().unwrap(),
            MIGRATIONS.last().unwrap().version
        );
        let retention = Retention {
            per_key: 3,
            total: 5,
            bytes: u64::MAX >> 1,
        };
        for i in 0..5 {
            db.insert(&[observation("t4", None, 1000.0 + i as f64)], retention)
                .unwrap();
        }
        db.insert(
            &[
                observation("t4", Some("torch2.5"), 2000.0),
                observation("l4", None, 3000.0),
                observation("l4", None, 3001.0),
            ],
            retention,
        )
        .unwrap();
        let rows = db.fit_rows().unwrap();
        assert_eq!(rows.len(), 5, "the total bound");
        assert_totals_match(&db);
        let t4: Vec<f64> = rows
            .iter()
            .filter(|r| r.gpu == "t4" && r.environment.is_none())
            .map(|r| r.observed_peak_mib)
            .collect();
        assert_eq!(
            t4,
            vec![1003.0, 1004.0],
            "the newest per key, then the total"
        );
        assert!(dir.path().join(format!("{SQLITE_FILE}-wal")).exists());
        drop(db);
        let again = SqliteDb::open(dir.path()).unwrap();
        assert_eq!(again.fit_rows().unwrap().len(), 5);
        let mut exported = Vec::new();
        again
            .export(&mut |o| {
                exported.push(o);
                Ok(())
            })
            .unwrap();
        assert_eq!(exported.len(), 5);
        assert_eq!(exported[0].job["batch_size"], 1);
        assert!(exported[0].recorded_at.ends_with('Z'));
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(SqliteDb::open(dir.path()).unwrap());
        let c = rusqlite::Connection::open(dir.path().join(SQLITE_FILE)).unwrap();
        c.execute("INSERT INTO schema_migrations VALUES (999, 0)", [])
            .unwrap();
        drop(c);
        let error = SqliteDb::open(dir.path()).unwrap_err().to_string();
        assert!(error.contains("newer"), "{error}");
    }

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact("postgres://gpucast:s3cret@db:5432/gpucast"),
            "postgres://…@db:5432/gpucast"
        );
        assert!(!redact("postgres://u:p@h/d?sslmode=disable").contains(":p@"));
    }
}
