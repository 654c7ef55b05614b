//! `gpucast observations export`: the stored observations as JSON Lines.

use std::io::{BufWriter, Write};
use std::path::Path;

use super::db::{self, DbError};

/// Writes every stored observation as one JSON line to `output` (replaced atomically) or to
/// standard output; returns how many were written. Opening the store applies its migrations.
pub fn export(
    data_dir: &Path,
    database_url: Option<&str>,
    output: Option<&Path>,
) -> anyhow::Result<u64> {
    if database_url.is_none() && !data_dir.join(db::SQLITE_FILE).exists() {
        anyhow::bail!(
            "no store at {}: give --data-dir or --database-url",
            data_dir.join(db::SQLITE_FILE).display()
        );
    }
    let db = db::open(data_dir, database_url)?;
    let mut count = 0u64;
    let mut write_all = |out: &mut dyn Write| -> Result<(), DbError> {
        db.export(&mut |row| {
            let line = serde_json::to_string(&row).map_err(|e| DbError::Other(e.to_string()))?;
            writeln!(out, "{line}").map_err(|e| DbError::Other(e.to_string()))?;
            count += 1;
            Ok(())
        })?;
        out.flush().map_err(|e| DbError::Other(e.to_string()))
    };
    match output {
        None => {
            let stdout = std::io::stdout();
            let mut out = BufWriter::new(stdout.lock());
            write_all(&mut out)?;
        }
        Some(path) => {
            let mut bytes = Vec::new();
            write_all(&mut bytes)?;
            // Written beside the target, then renamed over it: a reader never sees half a file.
            let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
            std::fs::write(&tmp, &bytes)?;
            std::fs::rename(&tmp, path)?;
        }
    }
    Ok(count)
}
