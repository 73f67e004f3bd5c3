//! Every example in the docs (the crate's doc comments and the README) builds with the
//! dependencies the Quickstart lists. The doctests compile them with this crate's own
//! dependencies, more than a user has (`http` among them); this reads which crates each
//! example names and holds them to the Quickstart's list, and to the `// Cargo.toml:` line
//! of an example that needs one more.

use std::{collections::BTreeSet, fs, path::Path};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The crates named in the `sections` of a Cargo.toml text, as Rust spells them.
fn crates_in(toml: &str, sections: &[&str]) -> BTreeSet<String> {
    let mut section = "";
    let mut names = BTreeSet::new();
    for line in toml.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if sections.contains(&section) && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                names.insert(name.trim().replace('-', "_"));
            }
        }
    }
    names
}

/// The Quickstart's `Cargo.toml`: the README's first TOML block.
fn quickstart() -> String {
    let readme = fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    let start = readme
        .find("```toml\n")
        .expect("the README's Quickstart lists its dependencies");
    let block = &readme[start + "```toml\n".len()..];
    block[..block.find("```").unwrap()].to_owned()
}

/// One example: where it is, and its lines (hidden ones too, without their `#`).
struct Example {
    at: String,
    lines: Vec<String>,
}

/// The Rust examples of a text whose lines carry `prefix` (`///`, `//!`, or none).
fn examples(file: &str, text: &str, prefixes: &[&str], out: &mut Vec<Example>) {
    let mut open: Option<Example> = None;
    let mut rust = false;
    for (n, line) in text.lines().enumerate() {
        let doc = if prefixes.is_empty() {
            Some(line)
        } else {
            let trimmed = line.trim_start();
            prefixes
                .iter()
                .find_map(|p| trimmed.strip_prefix(p))
                .map(|rest| rest.strip_prefix(' ').unwrap_or(rest))
        };
        let Some(doc) = doc else {
            open = None;
            continue;
        };
        if let Some(info) = doc.trim_start().strip_prefix("```") {
            match open.take() {
                Some(example) => {
                    if rust {
                        out.push(example);
                    }
                }
                None => {
                    let info = info.trim();
                    rust = !info.contains("compile_fail")
                        && (info.is_empty()
                            || info.split(',').all(|tag| {
                                matches!(tag.trim(), "rust" | "no_run" | "should_panic" | "ignore")
                            }));
                    open = Some(Example {
                        at: format!("{file}:{}", n + 1),
                        lines: Vec::new(),
                    });
                }
            }
            continue;
        }
        if let Some(example) = &mut open {
            let code = doc.trim_start();
            let code = code
                .strip_prefix("# ")
                .or(code.strip_prefix('#').filter(|c| c.is_empty()));
            example.lines.push(code.unwrap_or(doc).to_owned());
        }
    }
}

/// Every Rust example of the crate's doc comments and of the README.
fn all_examples() -> Vec<Example> {
    let mut out = Vec::new();
    let mut dirs = vec![Path::new(ROOT).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let file = path.strip_prefix(ROOT).unwrap().display().to_string();
                examples(
                    &file,
                    &fs::read_to_string(&path).unwrap(),
                    &["///", "//!"],
                    &mut out,
                );
            }
        }
    }
    let readme = fs::read_to_string(Path::new(ROOT).join("README.md")).unwrap();
    examples("README.md", &readme, &[], &mut out);
    out
}

/// The identifiers that start a path in `line` (`name::`, not after `::` or `.`).
fn path_roots(line: &str) -> Vec<&str> {
    let mut roots = Vec::new();
    let mut i = 0;
    while let Some(found) = line[i..].find("::") {
        let end = i + found;
        let start = line[..end]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(0, |p| p + 1);
        let before = &line[..start];
        if start < end && !before.ends_with("::") && !before.ends_with('.') {
            roots.push(&line[start..end]);
        }
        i = end + 2;
    }
    roots
}

/// The tokio feature a `tokio::module` needs, on `line`.
fn tokio_feature(module: &str, line: &str) -> Option<&'static str> {
    Some(match module {
        // The attribute's runtime is the multi-threaded one unless the line says otherwise.
        "main" if !line.contains("current_thread") => "rt-multi-thread",
        "main" | "test" | "select" | "join" | "try_join" | "pin" => "macros",
        "spawn" | "task" | "runtime" => "rt",
        "time" => "time",
        "sync" => "sync",
        "net" => "net",
        "fs" => "fs",
        "io" => "io-util",
        "signal" => "signal",
        "process" => "process",
        _ => return None,
    })
}

#[test]
fn every_example_in_the_docs_uses_only_what_the_quickstart_lists() {
    let manifest = fs::read_to_string(Path::new(ROOT).join("Cargo.toml")).unwrap();
    let crates = crates_in(&manifest, &["[dependencies]", "[dev-dependencies]"]);
    let quickstart = quickstart();
    let listed = crates_in(&quickstart, &["[dependencies]", "[dev-dependencies]"]);
    let tokio_line = quickstart.lines().find(|l| l.starts_with("tokio")).unwrap();
    let mut tokio_features: BTreeSet<&str> = [
        "macros",
        "rt",
        "rt-multi-thread",
        "time",
        "sync",
        "net",
        "fs",
        "io-util",
        "signal",
        "process",
    ]
    .into_iter()
    .filter(|f| tokio_line.contains(&format!("\"{f}\"")))
    .collect();
    if tokio_features.contains("rt-multi-thread") {
        tokio_features.insert("rt");
    }

    let examples = all_examples();
    assert!(
        examples.len() > 40,
        "found only {} examples",
        examples.len()
    );
    let mut wrong = Vec::new();
    for example in &examples {
        let mut allowed: BTreeSet<String> = listed.clone();
        allowed.extend(["tower_batch_lock", "std", "core", "alloc"].map(String::from));
        let text = example.lines.join("\n");
        for line in &example.lines {
            if let Some(needs) = line.trim().strip_prefix("// Cargo.toml:") {
                allowed.extend(crates_in(
                    &format!("[x]\n{}", needs.replace(", ", "\n")),
                    &["[x]"],
                ));
            }
        }
        // Names brought in by a `use` of an allowed crate (`tower_batch_lock::deadpool_redis`).
        for item in text.split("use ").skip(1) {
            let item = &item[..item.find(';').unwrap_or(item.len())];
            if path_roots(item)
                .first()
                .is_some_and(|root| allowed.contains(*root))
            {
                let names = item.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
                allowed.extend(names.filter(|n| !n.is_empty()).map(String::from));
            }
        }
        for (n, line) in example.lines.iter().enumerate() {
            for root in path_roots(line) {
                if crates.contains(root) && !allowed.contains(root) {
                    wrong.push(format!(
                        "{} (+{}): `{root}` is not in the Quickstart: {line}",
                        example.at,
                        n + 1
                    ));
                }
            }
            for (i, _) in line.match_indices("tokio::") {
                let module = line[i + "tokio::".len()..]
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .next()
                    .unwrap();
                if let Some(feature) =
                    tokio_feature(module, line).filter(|f| !tokio_features.contains(f))
                {
                    wrong.push(format!(
                        "{} (+{}): tokio's `{feature}` feature is not in the Quickstart: {line}",
                        example.at,
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
