//! The PostgreSQL store, shared by any number of replicas.

use super::*;

fn postgres_fit_row(r: &postgres::Row) -> FitRow {
    FitRow {
        id: r.get(0),
        batch_id: r.get(1),
        recorded_at: r.get(2),
        gpu: r.get(3),
        environment: r.get(4),
        observed_peak_mib: r.get(5),
        predicted_mib: r.get(6),
        breakdown: r.get(7),
        step_time: step_time(r.get(8), r.get(9)),
    }
}

/// A PostgreSQL database shared by replicas: one connection per process, reopened when lost.
pub struct PostgresDb {
    url: String,
    client: Mutex<Option<postgres::Client>>,
}

impl std::fmt::Debug for PostgresDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresDb")
            .field("server", &redact(&self.url))
            .finish()
    }
}

/// `postgres://user:secret@host/db` without the password (and anything before the host).
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://…@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.split('?').next().unwrap_or_default().to_string(),
    }
}

impl PostgresDb {
    pub fn open(url: &str) -> Result<PostgresDb, DbError> {
        let mut client = postgres::Client::connect(url, postgres::NoTls)?;
        migrate_postgres(&mut client)?;
        Ok(PostgresDb {
            url: url.to_string(),
            client: Mutex::new(Some(client)),
        })
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut postgres::Client) -> Result<T, postgres::Error>,
    ) -> Result<T, DbError> {
        let mut slot = self.client.lock().unwrap_or_else(|p| p.into_inner());
        if slot.as_ref().is_none_or(|c| c.is_closed()) {
            *slot = Some(postgres::Client::connect(&self.url, postgres::NoTls)?);
        }
        let client = slot.as_mut().expect("connected above");
        let result = f(client);
        if result.is_err() && client.is_closed() {
            *slot = None;
        }
        Ok(result?)
    }
}

fn migrate_postgres(client: &mut postgres::Client) -> Result<(), DbError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_at BIGINT NOT NULL)",
    )?;
    let current: i64 = tx
        .query_one(
            "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
            &[],
        )?
        .get(0);
    check_not_newer(current).map_err(DbError::Other)?;
    for migration in MIGRATIONS.iter().filter(|m| m.version > current) {
        tx.batch_execute(migration.postgres)?;
        tx.execute(
            "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)",
            &[&migration.version, &unix_now()],
        )?;
    }
    tx.commit()?;
    Ok(())
}

impl ObservationDb for PostgresDb {
    fn insert(&self, batch: &[NewObservation], retention: Retention) -> Result<(), DbError> {
        let batch_id = new_batch_id();
        let now = unix_now();
        let (per_key, total) = (retention.per_key as i64, retention.total as i64);
        self.with(|client| {
            // READ COMMITTED is enough: inserts never conflict, and a trim deletes only rows
            // beyond the bound whichever transaction sees them first.
            let mut tx = client.transaction()?;
            let insert = tx.prepare(
                "INSERT INTO observations (recorded_at, batch_id, gpu, environment, job, observed_peak_mib, predicted_mib, breakdown, source, step_time_ms, step_time_curve, bytes)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )?;
            for o in batch {
                tx.execute(
                    &insert,
                    &[
                        &now,
                        &batch_id,
                        &o.gpu,
                        &o.environment,
                        &o.job,
                        &o.observed_peak_mib,
                        &o.predicted_mib,
                        &o.breakdown,
                        &o.source.as_str(),
                        &o.step_time.as_ref().map(|s| s.0),
                        &o.step_time.as_ref().map(|s| s.1.as_str()),
                        &o.stored_bytes(),
                    ],
                )?;
            }
            for (gpu, environment) in keys(batch) {
                tx.execute(
                    "DELETE FROM observations WHERE gpu = $1 AND environment IS NOT DISTINCT FROM $2 AND id <=
                       (SELECT id FROM observations WHERE gpu = $1 AND environment IS NOT DISTINCT FROM $2
                        ORDER BY id DESC LIMIT 1 OFFSET $3)",
                    &[&gpu, &environment, &per_key],
                )?;
            }
            let rows: i64 = tx.query_one(TOTALS, &[])?.get(0);
            let excess = rows - total;
            if excess > 0 {
                tx.execute(
                    "DELETE FROM observations WHERE id <=
                       (SELECT id FROM observations ORDER BY id LIMIT 1 OFFSET $1 - 1)",
                    &[&excess],
                )?;
            }
            let bytes: i64 = tx.query_one(TOTALS, &[])?.get(1);
            let mut excess = bytes - retention.bytes as i64;
            let mut after = 0i64;
            while excess > 0 {
                let rows = tx.query(
                    "SELECT id, bytes FROM observations WHERE id > $1 ORDER BY id LIMIT $2",
                    &[&after, &TRIM_CHUNK],
                )?;
                let Some(last) = rows.last().map(|r| r.get::<_, i64>(0)) else {
                    break;
                };
                for row in &rows {
                    after = row.get(0);
                    excess -= row.get::<_, i64>(1);
                    if excess <= 0 {
                        break;
                    }
                }
                if excess > 0 {
                    after = last;
                }
            }
            if after > 0 {
                tx.execute("DELETE FROM observations WHERE id <= $1", &[&after])?;
            }
            tx.commit()
        })
    }

    fn fingerprint(&self) -> Result<Fingerprint, DbError> {
        self.with(|c| {
            let row = c.query_one(
                "SELECT (SELECT row_count FROM store_totals), COALESCE(MIN(id), 0)::BIGINT, COALESCE(MAX(id), 0)::BIGINT
                 FROM observations",
                &[],
            )?;
            Ok((row.get(0), row.get(1), row.get(2)))
        })
    }

    fn fit_rows(&self) -> Result<Vec<FitRow>, DbError> {
        self.with(|c| {
            let rows = c.query(&format!("{FIT_COLUMNS} ORDER BY id"), &[])?;
            Ok(rows.iter().map(postgres_fit_row).collect())
        })
    }

    fn fit_rows_of(&self, gpu: &str, environment: Option<&str>) -> Result<Vec<FitRow>, DbError> {
        self.with(|c| {
            let rows = c.query(
                &format!(
                    "{FIT_COLUMNS} WHERE gpu = $1 AND environment IS NOT DISTINCT FROM $2 ORDER BY id"
                ),
                &[&gpu, &environment],
            )?;
            Ok(rows.iter().map(postgres_fit_row).collect())
        })
    }

    fn export(
        &self,
        each: &mut dyn FnMut(ExportedObservation) -> Result<(), DbError>,
    ) -> Result<(), DbError> {
        let rows = self.with(|c| {
            c.query(
                "SELECT id, recorded_at, gpu, environment, job, observed_peak_mib, predicted_mib, breakdown, source, step_time_ms
                 FROM observations ORDER BY id",
                &[],
            )
        })?;
        for r in rows {
            each(ExportedObservation {
                id: r.get(0),
                recorded_at: timestamp(r.get(1)),
                gpu: r.get(2),
                environment: r.get(3),
                job: json_or_null(r.get(4)),
                observed_peak_mib: r.get(5),
                predicted_mib: r.get(6),
                breakdown: json_or_null(r.get(7)),
                source: Source::parse(r.get(8)),
                step_time_ms: r.get(9),
            })?;
        }
        Ok(())
    }

    fn schema_version(&self) -> Result<i64, DbError> {
        self.with(|c| {
            Ok(c.query_one(
                "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
                &[],
            )?
            .get(0))
        })
    }

    fn describe(&self) -> String {
        format!("postgres {}", redact(&self.url))
    }
}
