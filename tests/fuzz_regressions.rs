//! Replays every input saved under fuzz/regressions/<target>/ (crashes and slow inputs that
//! scripts/fuzz.sh found, kept after the fix, and hand-made seeds at each parser's limits)
//! through the same harness the fuzz targets use.
//! A regression panics here exactly as it did under libFuzzer.

use std::path::PathBuf;

#[path = "../fuzz/harness.rs"]
mod harness;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| {
            p.is_file()
                && !p
                    .file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| (p.clone(), std::fs::read(&p).expect("a readable input")))
        .collect()
}

fn replay(target: &str, run: fn(&[u8])) {
    let inputs = inputs(target);
    // An empty folder would make this test pass without replaying anything.
    assert!(
        !inputs.is_empty(),
        "fuzz/regressions/{target}/ holds no input"
    );
    for (path, data) in &inputs {
        let outcome = std::panic::catch_unwind(|| run(data));
        assert!(outcome.is_ok(), "{} panics again", path.display());
    }
    eprintln!("{target}: {} saved inputs replayed", inputs.len());
}

#[test]
fn saved_estimate_request_inputs_no_longer_crash() {
    replay("estimate_request", harness::estimate_request);
}

#[test]
fn saved_parse_summary_inputs_no_longer_crash() {
    replay("parse_summary", harness::summary);
}

#[test]
fn the_harness_accepts_the_seed_shapes() {
    // The harness itself works: a valid request and a summary pass through without panicking.
    harness::estimate_request(
        br#"{"batch_size": 8, "layers": [{"kind": "linear", "output_size": 10, "params": 110}]}"#,
    );
    harness::summary(b"\x00Conv2d-1 [-1, 64, 112, 112] 9,408");
}
