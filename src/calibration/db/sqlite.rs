//! The SQLite store: one file under `--data-dir`, in WAL mode; a damaged one is set aside.

use super::*;

fn sqlite_fit_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<FitRow> {
    Ok(FitRow {
        id: r.get(0)?,
        batch_id: r.get(1)?,
        recorded_at: r.get(2)?,
        gpu: r.get(3)?,
        environment: r.get(4)?,
        observed_peak_mib: r.get(5)?,
        predicted_mib: r.get(6)?,
        breakdown: r.get(7)?,
        step_time: step_time(r.get(8)?, r.get(9)?),
    })
}

#[derive(Debug)]
pub struct SqliteDb {
    path: PathBuf,
    connection: Mutex<rusqlite::Connection>,
    /// What opening found damaged and set aside.
    warnings: Vec<String>,
}

/// The file name of the SQLite database under `--data-dir`.
pub const SQLITE_FILE: &str = "gpucast.sqlite3";

impl SqliteDb {
    /// Opens (creating) the store in `data_dir`. A store that cannot be read (not a database,
    /// or failing SQLite's quick check) is moved into `damaged-<time>/` beside it and a new
    /// one started; a write-ahead log whose recovery would drop committed frames (garbage in
    /// a middle frame) is copied there before SQLite recovers what it can. Either way the
    /// service starts, and [`ObservationDb::startup_warnings`] says what happened.
    pub fn open(data_dir: &Path) -> Result<SqliteDb, DbError> {
        std::fs::create_dir_all(data_dir).map_err(|source| DbError::DataDir {
            path: data_dir.to_path_buf(),
            source,
        })?;
        let path = data_dir.join(SQLITE_FILE);
        let mut warnings = Vec::new();
        if let Some(checked) = std::fs::read(sidecar(&path, "-wal"))
            .ok()
            .and_then(|bytes| crate::calibration::wal::check(&bytes))
            .filter(|c| c.lost_frames > 0)
        {
            let kept = set_aside(data_dir, &path, false)?;
            warnings.push(format!(
                "the write-ahead log holds {} frames after a damaged one, which SQLite's recovery \
                 drops (it keeps {}): the store and its log as found are copied to {}",
                checked.lost_frames,
                checked.recovered_frames,
                kept.display()
            ));
        }
        let connection = match connect(&path) {
            Ok(connection) => connection,
            Err(error) if damaged(&error) => {
                let moved = set_aside(data_dir, &path, true)?;
                warnings.push(format!(
                    "the store could not be read ({error}): moved to {} and a new one started",
                    moved.display()
                ));
                connect(&path)?
            }
            Err(error) => return Err(error),
        };
        for warning in &warnings {
            tracing::error!(store = %path.display(), "{warning}");
        }
        Ok(SqliteDb {
            path,
            connection: Mutex::new(connection),
            warnings,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&mut rusqlite::Connection) -> rusqlite::Result<T>,
    ) -> Result<T, DbError> {
        let mut connection = self.connection.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut connection).map_err(|source| DbError::Sqlite {
            path: self.path.clone(),
            source,
        })
    }
}

/// The file `path` with `suffix` appended (`-wal`, `-shm`).
pub(super) fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Opens the SQLite file in WAL mode, checks it, and migrates it.
fn connect(path: &Path) -> Result<rusqlite::Connection, DbError> {
    let error = |source| DbError::Sqlite {
        path: path.to_path_buf(),
        source,
    };
    let mut connection = rusqlite::Connection::open(path).map_err(error)?;
    connection
        .busy_timeout(std::time::Duration::from_secs(5))
        .map_err(error)?;
    // WAL: readers (an export, another process) never block the writer, and a commit is
    // one append. synchronous=FULL: a recorded observation survives a power cut.
    connection
        .pragma_update(None, "journal_mode", "WAL")
        .map_err(error)?;
    connection
        .pragma_update(None, "synchronous", "FULL")
        .map_err(error)?;
    let verdict: String = connection
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(error)?;
    if verdict != "ok" {
        return Err(DbError::Damaged(format!(
            "quick_check: {}",
            crate::job::echo(&verdict)
        )));
    }
    migrate_sqlite(&mut connection).map_err(error)?;
    Ok(connection)
}

/// Whether opening failed because the file is not a sound database (rather than, say, a
/// permission or a newer schema): what setting it aside and starting anew can cure.
fn damaged(error: &DbError) -> bool {
    match error {
        DbError::Damaged(_) => true,
        DbError::Sqlite { source, .. } => matches!(
            source.sqlite_error_code(),
            Some(rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase)
        ),
        _ => false,
    }
}

/// Copies (or moves) the store's files into a new `damaged-<unix time>` directory beside
/// them; returns it.
fn set_aside(data_dir: &Path, path: &Path, move_files: bool) -> Result<PathBuf, DbError> {
    let io = |e: std::io::Error| DbError::Other(format!("setting the store aside: {e}"));
    let mut dir = data_dir.join(format!("damaged-{}", unix_now()));
    let mut n = 1;
    while dir.exists() {
        n += 1;
        dir = data_dir.join(format!("damaged-{}-{n}", unix_now()));
    }
    std::fs::create_dir_all(&dir).map_err(io)?;
    for suffix in ["", "-wal", "-shm"] {
        let from = sidecar(path, suffix);
        if !from.exists() {
            continue;
        }
        let to = dir.join(from.file_name().unwrap_or_default());
        if move_files {
            std::fs::rename(&from, &to).map_err(io)?;
        } else {
            std::fs::copy(&from, &to).map_err(io)?;
        }
    }
    Ok(dir)
}

fn migrate_sqlite(connection: &mut rusqlite::Connection) -> rusqlite::Result<()> {
    let tx = connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    tx.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)",
    )?;
    let current: i64 = tx.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
        [],
        |r| r.get(0),
    )?;
    check_not_newer(current).map_err(rusqlite::Error::InvalidParameterName)?;
    for migration in MIGRATIONS.iter().filter(|m| m.version > current) {
        tx.execute_batch(migration.sqlite)?;
        tx.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES (?1, ?2)",
            rusqlite::params![migration.version, unix_now()],
        )?;
    }
    tx.commit()
}

impl ObservationDb for SqliteDb {
    fn insert(&self, batch: &[NewObservation], retention: Retention) -> Result<(), DbError> {
        let batch_id = new_batch_id();
        let now = unix_now();
        self.with(|connection| {
            let tx = connection.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            {
                let mut insert = tx.prepare_cached(
                    "INSERT INTO observations (recorded_at, batch_id, gpu, environment, job, observed_peak_mib, predicted_mib, breakdown, source, step_time_ms, step_time_curve, bytes)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                )?;
                for o in batch {
                    insert.execute(rusqlite::params![
                        now,
                        batch_id,
                        o.gpu,
                        o.environment,
                        o.job,
                        o.observed_peak_mib,
                        o.predicted_mib,
                        o.breakdown,
                        o.source.as_str(),
                        o.step_time.as_ref().map(|s| s.0),
                        o.step_time.as_ref().map(|s| &s.1),
                        o.stored_bytes(),
                    ])?;
                }
                let mut trim = tx.prepare_cached(
                    "DELETE FROM observations WHERE gpu = ?1 AND environment IS ?2 AND id <=
                       (SELECT id FROM observations WHERE gpu = ?1 AND environment IS ?2
                        ORDER BY id DESC LIMIT 1 OFFSET ?3)",
                )?;
                for (gpu, environment) in keys(batch) {
                    trim.execute(rusqlite::params![gpu, environment, retention.per_key as i64])?;
                }
                let (rows, _) = tx.query_row(TOTALS, [], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
                let excess = rows - retention.total as i64;
                if excess > 0 {
                    tx.execute(
                        "DELETE FROM observations WHERE id <=
                           (SELECT id FROM observations ORDER BY id LIMIT 1 OFFSET ?1 - 1)",
                        [excess],
                    )?;
                }
                let (_, bytes) = tx.query_row(TOTALS, [], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)))?;
                let mut excess = bytes - retention.bytes as i64;
                let mut after = 0i64;
                let mut chunk = tx.prepare_cached(
                    "SELECT id, bytes FROM observations WHERE id > ?1 ORDER BY id LIMIT ?2",
                )?;
                while excess > 0 {
                    let rows: Vec<(i64, i64)> = chunk
                        .query_map([after, TRIM_CHUNK], |r| Ok((r.get(0)?, r.get(1)?)))?
                        .collect::<Result<_, _>>()?;
                    let Some(&(last, _)) = rows.last() else { break };
                    for (id, row_bytes) in rows {
                        after = id;
                        excess -= row_bytes;
                        if excess <= 0 {
                            break;
                        }
                    }
                    if excess > 0 {
                        after = last;
                    }
                }
                if after > 0 {
                    tx.execute("DELETE FROM observations WHERE id <= ?1", [after])?;
                }
            }
            tx.commit()
        })
    }

    fn fingerprint(&self) -> Result<Fingerprint, DbError> {
        self.with(|c| {
            c.query_row(
                "SELECT (SELECT row_count FROM store_totals), COALESCE(MIN(id), 0), COALESCE(MAX(id), 0)
                 FROM observations",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
        })
    }

    fn fit_rows(&self) -> Result<Vec<FitRow>, DbError> {
        self.with(|c| {
            let mut statement = c.prepare_cached(&format!("{FIT_COLUMNS} ORDER BY id"))?;
            let rows = statement.query_map([], sqlite_fit_row)?;
            rows.collect()
        })
    }

    fn fit_rows_of(&self, gpu: &str, environment: Option<&str>) -> Result<Vec<FitRow>, DbError> {
        self.with(|c| {
            let mut statement = c.prepare_cached(&format!(
                "{FIT_COLUMNS} WHERE gpu = ?1 AND environment IS ?2 ORDER BY id"
            ))?;
            let rows = statement.query_map(rusqlite::params![gpu, environment], sqlite_fit_row)?;
            rows.collect()
        })
    }

    fn export(
        &self,
        each: &mut dyn FnMut(ExportedObservation) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        let mut failed = None;
        self.with(|c| {
            let mut statement = c.prepare(
                "SELECT id, recorded_at, gpu, environment, job, observed_peak_mib, predicted_mib, breakdown, source, step_time_ms
                 FROM observations ORDER BY id",
            )?;
            let mut rows = statement.query([])?;
            while let Some(r) = rows.next()? {
                let row = ExportedObservation {
                    id: r.get(0)?,
                    recorded_at: timestamp(r.get(1)?),
                    gpu: r.get(2)?,
                    environment: r.get(3)?,
                    job: json_or_null(&r.get::<_, String>(4)?),
                    observed_peak_mib: r.get(5)?,
                    predicted_mib: r.get(6)?,
                    breakdown: json_or_null(&r.get::<_, String>(7)?),
                    source: Source::parse(&r.get::<_, String>(8)?),
                    step_time_ms: r.get(9)?,
                };
                if let Err(e) = each(row) {
                    failed = Some(e);
                    break;
                }
            }
            Ok(())
        })?;
        failed.map_or(Ok(()), Err)
    }

    fn schema_version(&self) -> Result<i64, DbError> {
        self.with(|c| {
            c.query_row(
                "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
                [],
                |r| r.get(0),
            )
        })
    }

    fn describe(&self) -> String {
        format!("sqlite {}", self.path.display())
    }

    fn startup_warnings(&self) -> Vec<String> {
        self.warnings.clone()
    }
}
