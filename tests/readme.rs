//! The README and CONTRIBUTING against the tree and the committed answers: CONTRIBUTING.md's
//! Layout block (the map of src/) names every source file and folder and nothing that is not
//! there, and every figure the README quotes from an example answer is what that committed
//! answer says (tests/api/docs.rs holds the committed answers to what the service answers now).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(repo().join("README.md")).unwrap()
}

/// The first fenced block under the `## Layout` heading.
fn layout_block(readme: &str) -> String {
    let start = readme.find("\n## Layout").expect("a Layout section");
    let rest = &readme[start..];
    let open = rest.find("```").expect("a fenced block") + 3;
    let close = open + rest[open..].find("```").expect("the block closes");
    rest[open..close].to_string()
}

/// Words of the block that look like `name.rs` or `name/`.
fn named(block: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut files, mut folders) = (BTreeSet::new(), BTreeSet::new());
    for word in block.split(|c: char| c.is_whitespace() || c == ',' || c == ';' || c == ':') {
        let word = word.trim_matches(|c: char| c == '(' || c == ')' || c == '`');
        let is_name = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        };
        if let Some(stem) = word.strip_suffix(".rs") {
            if is_name(stem) {
                files.insert(word.to_string());
            }
        } else if let Some(stem) = word.strip_suffix('/') {
            if is_name(stem) {
                folders.insert(word.to_string());
            }
        }
    }
    (files, folders)
}

fn walk(dir: &Path, files: &mut BTreeSet<String>, folders: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            folders.insert(format!("{name}/"));
            walk(&path, files, folders);
        } else if name.ends_with(".rs") {
            files.insert(name);
        }
    }
}

#[test]
fn the_layout_names_every_source_file_and_folder_and_nothing_else() {
    let contributing = std::fs::read_to_string(repo().join("CONTRIBUTING.md")).unwrap();
    let (named_files, named_folders) = named(&layout_block(&contributing));
    let (mut files, mut folders) = (BTreeSet::new(), BTreeSet::new());
    walk(&repo().join("src"), &mut files, &mut folders);
    let missing: Vec<_> = files.difference(&named_files).collect();
    assert!(
        missing.is_empty(),
        "source files the Layout omits: {missing:?}"
    );
    let missing: Vec<_> = folders.difference(&named_folders).collect();
    assert!(missing.is_empty(), "folders the Layout omits: {missing:?}");
    let stale: Vec<_> = named_files.difference(&files).collect();
    assert!(
        stale.is_empty(),
        "files the Layout names that src/ lacks: {stale:?}"
    );
}

/// `<!-- quoted: FILE path.to.value ... -->` follows each example answer the README quotes;
/// every value at those paths of the committed file appears verbatim in the text between the
/// previous marker (or the start) and this one.
#[test]
fn figures_quoted_from_example_answers_are_the_committed_answers() {
    let readme = readme();
    let mut from = 0;
    let mut markers = 0;
    while let Some(at) = readme[from..].find("<!-- quoted:") {
        let start = from + at;
        let end = start + readme[start..].find("-->").expect("the marker closes");
        let mut words = readme[start + "<!-- quoted:".len()..end].split_whitespace();
        let file = words.next().expect("a file");
        let answer: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(repo().join(file)).unwrap()).unwrap();
        let text = &readme[from..start];
        for path in words {
            let value = path
                .split('.')
                .fold(&answer, |v, key| match key.parse::<usize>() {
                    Ok(i) => &v[i],
                    Err(_) => &v[key],
                });
            assert!(
                value.is_number(),
                "{file} {path}: not a number in the committed answer"
            );
            let figure = value.to_string();
            assert!(
                text.contains(&figure),
                "{file} {path}: the README quotes another figure than {figure}"
            );
        }
        markers += 1;
        from = end;
    }
    println!("{markers} quoted answers checked");
}

/// Every `gpucast estimate ... --format table` command the README shows is followed by a
/// `text` block holding its output, and that is what the command prints now.
#[test]
fn the_readmes_command_line_examples_show_their_output() {
    let readme = readme();
    let blocks: Vec<(&str, &str)> = readme
        .split("```")
        .skip(1)
        .step_by(2)
        .filter_map(|block| block.split_once('\n'))
        .collect();
    let mut checked = 0;
    for (i, (lang, body)) in blocks.iter().enumerate() {
        let command = body.trim();
        if *lang != "sh"
            || !(command.starts_with("gpucast estimate") || command.starts_with("gpucast plan"))
            || !command.contains("--format table")
        {
            continue;
        }
        let (next_lang, shown) = blocks.get(i + 1).copied().unwrap_or(("", ""));
        assert_eq!(next_lang, "text", "no output shown after `{command}`");
        let args: Vec<String> = command
            .replace("\\\n", " ")
            .split_whitespace()
            .skip(1)
            .map(str::to_string)
            .collect();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpucast"))
            .args(&args)
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "`{command}`: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            *shown,
            "`{command}`"
        );
        checked += 1;
    }
    assert!(checked >= 2, "{checked} examples checked");
}

/// The table of serve's flags in docs/user/operations.md names exactly the flags
/// `gpucast serve --help` lists (the code is the reference; the table says what each bounds).
#[test]
fn the_configuration_table_names_every_serve_flag_and_no_other() {
    let flag_words = |text: &str| -> BTreeSet<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .filter(|w| w.starts_with("--") && w.len() > 2)
            .map(str::to_string)
            .collect()
    };
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_gpucast"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let mut listed: BTreeSet<String> = String::from_utf8(help.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|w| w.starts_with("--"))
        .map(|w| w.trim_end_matches(',').to_string())
        .collect();
    listed.remove("--help");
    let operations = std::fs::read_to_string(repo().join("docs/user/operations.md")).unwrap();
    let start = operations
        .find("\n## Configuration")
        .expect("a Configuration section");
    let section = &operations[start..];
    let end = section[1..].find("\n## ").map_or(section.len(), |e| e + 1);
    let rows = section[..end]
        .lines()
        .filter(|l| l.starts_with("| `--"))
        .map(|l| l.split('|').nth(1).unwrap())
        .collect::<Vec<_>>()
        .join(" ");
    let tabled = flag_words(&rows);
    assert_eq!(
        tabled, listed,
        "docs/user/operations.md's Configuration table against `gpucast serve --help`"
    );
}
