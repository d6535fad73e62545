//! The rules ARCHITECTURE.md states, enforced by `cargo test` (rust-analyzer's tidy tests are
//! the model): the crate arrows (read from `cargo metadata`), a `//!` opening every `.rs` file,
//! an invariant comment above every `unwrap()`/`expect(` in library code, no system library in
//! the main job's build, ARCHITECTURE.md's code map naming every source file and nothing that
//! does not exist, `unsafe` code only where the map says, no import circle between a crate's
//! files, and a GPU backend's test subset that matches tests and starts no example program.
//! Each rule is a pure function over
//! text, tested on inputs that break it, then run over the repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Library crates that sit on `core` and must not depend on each other: every package under
/// `crates/` except `core` itself and the facade, which re-exports them all.
fn is_layered(name: &str, manifest: &str) -> bool {
    manifest.contains("/crates/") && name != "flashover-core" && name != "flashover"
}

/// The workspace crates a layered crate may depend on: `core`, and for the two crates that
/// meet in model surgery (the surgeries and the layers they change), `surgery`; streamed
/// datasets reach object stores through checkpoint's store handle (`remote::RemoteStore`:
/// one client, its settings and credential handling, for checkpoints and shards alike).
fn allowed_dependencies(name: &str) -> &'static [&'static str] {
    match name {
        "flashover-algorithms" | "flashover-models" => &["flashover-core", "flashover-surgery"],
        "flashover-streaming" => &["flashover-core", "flashover-checkpoint"],
        _ => &["flashover-core"],
    }
}

/// Every dependency arrow of `cargo metadata` output that breaks the layering: `core` depends
/// on no other workspace crate, and a layered crate on none but those
/// [`allowed_dependencies`] names (any dependency kind).
fn arrow_violations(metadata: &Value) -> Vec<String> {
    let packages = metadata["packages"].as_array().cloned().unwrap_or_default();
    let members: Vec<String> = packages
        .iter()
        .filter_map(|p| p["name"].as_str().map(String::from))
        .collect();
    let mut out = Vec::new();
    for p in &packages {
        let name = p["name"].as_str().unwrap_or_default();
        let manifest = p["manifest_path"]
            .as_str()
            .unwrap_or_default()
            .replace('\\', "/");
        let deps = p["dependencies"].as_array().cloned().unwrap_or_default();
        for d in deps {
            let dep = d["name"].as_str().unwrap_or_default();
            if !members.iter().any(|m| m == dep) {
                continue;
            }
            let kind = d["kind"].as_str().unwrap_or("normal");
            if name == "flashover-core" {
                out.push(format!("flashover-core depends on {dep} ({kind}); core depends on no other Flashover crate"));
            } else if is_layered(name, &manifest) && !allowed_dependencies(name).contains(&dep) {
                out.push(format!(
                    "{name} depends on {dep} ({kind}); it may depend on {} only",
                    allowed_dependencies(name).join(" and ")
                ));
            }
        }
    }
    out
}

/// Every `.rs` file under `root` (skipping `target` folders and hidden ones).
fn rust_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Whether a file's text opens with a `//!` comment.
fn opens_with_module_doc(text: &str) -> bool {
    text.trim_start_matches('\u{feff}').starts_with("//!")
}

/// The code of a line without string literals and a trailing `//` comment (roughly: enough
/// to find calls, not a Rust lexer).
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut in_str = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if in_str {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            // A character literal holding a quote (`'"'`, `'\"'`) opens no string.
            '\'' if chars.peek() == Some(&'"') => {
                chars.next();
                out.push_str("'\"");
            }
            '"' => {
                in_str = true;
                out.push_str("\"\"");
            }
            '/' if chars.peek() == Some(&'/') => break,
            _ => out.push(c),
        }
    }
    out
}

fn is_comment(line: &str) -> bool {
    line.trim_start().starts_with("//")
}

/// A plain `//` comment that says something (not a doc comment, not a to-do marker).
fn is_invariant_comment(line: &str) -> bool {
    let t = line.trim_start();
    let text = t.trim_start_matches('/').trim();
    let marker = ["TODO", "FIXME", "XXX", "HACK"]
        .iter()
        .any(|m| text.starts_with(m));
    t.starts_with("//")
        && !t.starts_with("///")
        && !t.starts_with("//!")
        && !text.is_empty()
        && !marker
}

/// Lines (1-based) of `text` with an `unwrap()` or `expect(` call in library code that has no
/// `//` comment on the line above its statement. Test modules (`#[cfg(test)]` up to the end
/// of the item that follows) and comments are skipped.
fn unexplained_unwraps(text: &str) -> Vec<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut skip_depth: Option<i64> = None;
    let mut depth: i64 = 0;
    let mut pending_cfg_test = false;
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        if is_comment(line) {
            continue;
        }
        let code = code_of(line);
        if trimmed.starts_with("#[cfg(test)]") {
            pending_cfg_test = true;
            continue;
        }
        let opens = code.matches('{').count() as i64;
        let closes = code.matches('}').count() as i64;
        if pending_cfg_test && opens > 0 {
            skip_depth = Some(depth);
            pending_cfg_test = false;
        } else if pending_cfg_test && code.trim_end().ends_with(';') {
            // `#[cfg(test)] use ...;`: the attribute covered one line.
            pending_cfg_test = false;
        }
        let in_test = skip_depth.is_some();
        depth += opens - closes;
        if let Some(d) = skip_depth {
            if depth <= d {
                skip_depth = None;
            }
        }
        if in_test || !(code.contains(".unwrap()") || code.contains(".expect(")) {
            continue;
        }
        // Walk up to the first line of the statement: a line continues the one above unless
        // that one ends a statement, opens or closes a block, or ends a match arm.
        let mut start = i;
        while start > 0 {
            let above = lines[start - 1];
            if is_comment(above) || above.trim().is_empty() {
                break;
            }
            let end = code_of(above).trim_end().to_string();
            if end.ends_with(';') || end.ends_with('{') || end.ends_with('}') || end.ends_with(',')
            {
                break;
            }
            start -= 1;
        }
        let explained = start > 0 && is_invariant_comment(lines[start - 1]);
        if !explained {
            out.push(i + 1);
        }
    }
    out
}

/// Calls that are allowed without a comment above them, with the reason: (file, code, why).
const ALLOWED: &[(&str, &str, &str)] = &[];

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives inside the workspace")
        .to_path_buf()
}

#[test]
fn the_arrow_rule_catches_a_sibling_dependency() {
    let meta = serde_json::json!({"packages": [
        {"name": "flashover-core", "manifest_path": "/w/crates/core/Cargo.toml", "dependencies": [
            {"name": "burn", "kind": null}]},
        {"name": "flashover-algorithms", "manifest_path": "/w/crates/algorithms/Cargo.toml", "dependencies": [
            {"name": "flashover-core", "kind": null},
            {"name": "flashover-surgery", "kind": null},
            {"name": "flashover-callbacks", "kind": "dev"}]},
        {"name": "flashover-callbacks", "manifest_path": "/w/crates/callbacks/Cargo.toml", "dependencies": [
            {"name": "flashover-core", "kind": null}]},
        {"name": "flashover-models", "manifest_path": "/w/crates/models/Cargo.toml", "dependencies": [
            {"name": "flashover-checkpoint", "kind": null}]},
        {"name": "flashover-checkpoint", "manifest_path": "/w/crates/checkpoint/Cargo.toml", "dependencies": [
            {"name": "flashover-surgery", "kind": null}]},
        {"name": "flashover-surgery", "manifest_path": "/w/crates/surgery/Cargo.toml", "dependencies": [
            {"name": "flashover-models", "kind": null}]},
        {"name": "flashover", "manifest_path": "/w/crates/flashover/Cargo.toml", "dependencies": [
            {"name": "flashover-algorithms", "kind": null}]},
    ]});
    let v = arrow_violations(&meta);
    assert_eq!(v.len(), 4, "{v:?}");
    assert!(
        v[0].contains("flashover-algorithms depends on flashover-callbacks (dev)"),
        "{v:?}"
    );
    assert!(
        v[1].contains("flashover-models depends on flashover-checkpoint"),
        "{v:?}"
    );
    // Surgery is a dependency of algorithms and models only, and itself sits on core.
    assert!(
        v[2].contains("flashover-checkpoint depends on flashover-surgery"),
        "{v:?}"
    );
    assert!(
        v[3].contains("flashover-surgery depends on flashover-models"),
        "{v:?}"
    );
    let core = serde_json::json!({"packages": [
        {"name": "flashover-core", "manifest_path": "/w/crates/core/Cargo.toml", "dependencies": [
            {"name": "flashover-algorithms", "kind": null}]},
        {"name": "flashover-algorithms", "manifest_path": "/w/crates/algorithms/Cargo.toml", "dependencies": []},
    ]});
    assert_eq!(arrow_violations(&core).len(), 1);
}

#[test]
fn crate_arrows_point_down_to_core_only() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(workspace_root())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata prints JSON");
    let names: Vec<&str> = meta["packages"]
        .as_array()
        .map(|p| p.iter().filter_map(|p| p["name"].as_str()).collect())
        .unwrap_or_default();
    for expected in [
        "flashover-core",
        "flashover-algorithms",
        "flashover-callbacks",
        "flashover-checkpoint",
        "flashover-surgery",
    ] {
        assert!(
            names.contains(&expected),
            "{expected} missing from {names:?}"
        );
    }
    let v = arrow_violations(&meta);
    assert!(v.is_empty(), "crate arrows broken:\n{}", v.join("\n"));
}

#[test]
fn the_module_doc_rule_catches_a_bare_file() {
    assert!(opens_with_module_doc("//! What this file owns.\nuse x;"));
    assert!(!opens_with_module_doc("use x;\n//! late"));
    assert!(!opens_with_module_doc("/// an item doc\nfn f() {}"));
    assert!(!opens_with_module_doc("\n//! after a blank line"));
}

#[test]
fn every_rust_file_opens_with_a_module_doc() {
    let root = workspace_root();
    let mut bare = Vec::new();
    let mut seen = 0;
    for dir in ["crates", "examples", "tests", "xtask", "benches"] {
        for f in rust_files(&root.join(dir)) {
            seen += 1;
            let text = std::fs::read_to_string(&f).expect("source files are UTF-8");
            if !opens_with_module_doc(&text) {
                bare.push(f.strip_prefix(&root).unwrap_or(&f).display().to_string());
            }
        }
    }
    assert!(
        seen > 50,
        "found only {seen} files under {}",
        root.display()
    );
    assert!(
        bare.is_empty(),
        "files without a `//!` opening:\n{}",
        bare.join("\n")
    );
}

#[test]
fn the_unwrap_rule_catches_unexplained_calls_only() {
    let src = r#"//! A file.
fn a(x: Option<u8>) -> u8 {
    x.unwrap()
}
fn b(x: Option<u8>) -> u8 {
    // Invariant: callers pass Some.
    x.unwrap()
}
fn c(x: Option<u8>) -> u8 {
    // Invariant: the chain below cannot be empty.
    let y = x
        .map(|v| v + 1)
        .expect("present");
    y
}
fn d(x: Option<u8>) -> u8 {
    /// A doc comment is not an invariant.
    x.expect("missing")
}
fn e(x: Option<u8>) -> u8 {
    let s = "not a call: .unwrap()";
    let q = '"';
    x.unwrap_or_default() + s.len() as u8 + q as u8
}
#[cfg(test)]
mod tests {
    fn t(x: Option<u8>) -> u8 {
        x.unwrap()
    }
}
fn f(x: Option<u8>) -> u8 {
    x.unwrap()
}
fn g(x: Option<u8>) -> u8 {
    // TODO: explain
    x.unwrap()
}
"#;
    assert_eq!(unexplained_unwraps(src), vec![3, 18, 32, 36]);
}

#[test]
fn library_unwraps_carry_their_invariant() {
    let root = workspace_root();
    let mut bad = Vec::new();
    for f in rust_files(&root.join("crates")) {
        let rel = f.strip_prefix(&root).unwrap_or(&f).display().to_string();
        // Only library code: the crates' `src/` folders.
        if !rel.contains("/src/") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("source files are UTF-8");
        let lines: Vec<&str> = text.lines().collect();
        for n in unexplained_unwraps(&text) {
            let code = lines[n - 1].trim();
            let allowed = ALLOWED
                .iter()
                .any(|(file, snippet, _)| rel.ends_with(file) && code.contains(snippet));
            if !allowed {
                bad.push(format!("{rel}:{n}: {code}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "unwrap/expect in library code without an invariant comment on the line above \
         (add one saying why it cannot fail, or list it in ALLOWED with a reason):\n{}",
        bad.join("\n")
    );
}

/// Crates in the main job's build graph that declare `links` yet need no system library
/// (they build their native code from their own sources, so a C compiler is all a machine
/// needs, or link nothing at all), with why each may stay.
const VENDORED_NATIVE: &[(&str, &str)] = &[
    (
        "ring",
        "compiles its own C and assembly (TLS for the object-store client)",
    ),
    (
        "libmimalloc-sys",
        "compiles mimalloc's C sources, shipped in the crate",
    ),
    (
        "zstd-sys",
        "compiles zstd's C sources, shipped in the crate (the shard codecs of flashover-streaming)",
    ),
    (
        "rayon-core",
        "declares `links` only so that one version of it is linked; no native code",
    ),
];

/// The packages of `graph` (names) whose `cargo metadata` entry declares a native library
/// (`links`) that they do not build themselves: what would need a system library (OpenMPI's
/// `mpi-sys`, `openssl-sys`...) on the user's machine.
fn system_library_links(graph: &[String], metadata: &Value) -> Vec<String> {
    let packages = metadata["packages"].as_array().cloned().unwrap_or_default();
    let mut out: Vec<String> = packages
        .iter()
        .filter(|p| graph.iter().any(|g| p["name"].as_str() == Some(g)))
        .filter_map(|p| {
            let links = p["links"].as_str()?;
            let name = p["name"].as_str()?;
            (!VENDORED_NATIVE.iter().any(|(n, _)| *n == name))
                .then(|| format!("{name} (links `{links}`)"))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[test]
fn the_system_library_rule_catches_mpi_sys() {
    let meta = serde_json::json!({"packages": [
        {"name": "mpi-sys", "links": "mpi"},
        {"name": "ring", "links": "ring_core_0_17_14_"},
        {"name": "serde", "links": null},
        {"name": "openssl-sys", "links": "openssl"},
    ]});
    let graph: Vec<String> = ["serde", "ring", "mpi-sys"].map(String::from).to_vec();
    assert_eq!(
        system_library_links(&graph, &meta),
        vec!["mpi-sys (links `mpi`)"]
    );
}

/// `cargo run --release --example mnist` from the root builds the default members with
/// their features unified (dev-dependencies included, as for any example): the README's
/// first command must build on a machine with only Rust and a C compiler, so nothing in that
/// graph may link a system library (OpenMPI is an opt-in feature, see `support/mpi.rs`).
#[test]
fn the_main_job_links_no_system_library() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let run = |args: &[&str]| -> Vec<u8> {
        let out = std::process::Command::new(&cargo)
            .args(args)
            .current_dir(workspace_root())
            .output()
            .expect("cargo runs");
        assert!(
            out.status.success(),
            "cargo {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    // The host's graph of the default members, every edge kind a build of an example follows.
    let tree = run(&[
        "tree",
        "--offline",
        "-e",
        "normal,build,dev",
        "--prefix",
        "none",
        "--format",
        "{p}",
    ]);
    let graph: Vec<String> = String::from_utf8_lossy(&tree)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect();
    assert!(
        graph.iter().any(|g| g == "flashover-examples") && graph.iter().any(|g| g == "burn"),
        "cargo tree listed an unexpected graph: {graph:?}"
    );
    // Every package's `links`, for this host's platform (others are not downloaded).
    let rustc =
        std::process::Command::new(std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into()))
            .arg("-vV")
            .output()
            .expect("rustc runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("rustc -vV names the host");
    let meta: Value = serde_json::from_slice(&run(&[
        "metadata",
        "--format-version",
        "1",
        "--offline",
        "--filter-platform",
        &host,
    ]))
    .expect("cargo metadata prints JSON");
    let v = system_library_links(&graph, &meta);
    assert!(
        v.is_empty(),
        "the main job's build graph links system libraries a fresh machine lacks: {}\n\
         (make them opt-in features, as `mpi` is; `cargo tree -e features -i <crate>` shows who turns them on)",
        v.join(", ")
    );
}

/// The code map's sections: each `### \`<root>\`` heading under `## Code map` with the text
/// up to the next heading.
fn code_map_sections(architecture: &str) -> Vec<(String, String)> {
    let Some(start) = architecture.find("## Code map") else {
        return Vec::new();
    };
    let map = &architecture[start..];
    let end = map[3..].find("\n## ").map_or(map.len(), |i| i + 3);
    let mut out: Vec<(String, String)> = Vec::new();
    for line in map[..end].lines() {
        if let Some(rest) = line.strip_prefix("### `") {
            let root = rest.split('`').next().unwrap_or_default();
            out.push((root.trim_end_matches('/').to_string(), String::new()));
        } else if line.starts_with("### ") {
            // A subsection that is not a folder's (such as "Adding an algorithm"): its text
            // belongs to no section.
            out.push((String::new(), String::new()));
        } else if let Some((_, text)) = out.last_mut() {
            text.push_str(line);
            text.push('\n');
        }
    }
    out.retain(|(root, _)| !root.is_empty());
    out
}

/// The path-like words inside backticks: those ending in `.rs` or `/` (no placeholders).
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .flat_map(|code| code.split([' ', '(', ')', ',']))
        .filter(|w| {
            (w.ends_with(".rs") || w.ends_with('/'))
                && !w.contains(['<', '*', ':'])
                && w.chars().any(|c| c.is_ascii_alphanumeric())
        })
        .map(String::from)
        .collect()
}

/// Whether `path` (relative, `/`-separated) is `name` or ends with `/name`.
fn ends_with_path(path: &str, name: &str) -> bool {
    path == name || path.ends_with(&format!("/{name}"))
}

/// The `.rs` files and the folders under a section's root, relative to it.
type Listing = (Vec<String>, Vec<String>);

/// What the code map gets wrong about the files under `root` (`/`-separated paths of the
/// `.rs` files and folders under each section's root, relative to it): a source file that its
/// section does not name (by its name, or by a path ending in it), and a named `.rs` file or
/// folder that does not exist (in the section's root, or from the workspace root when the
/// name starts with a top-level folder).
fn code_map_errors(
    sections: &[(String, String)],
    files_of: &dyn Fn(&str) -> Listing,
) -> Vec<String> {
    let mut out = Vec::new();
    for (root, text) in sections {
        let (files, dirs) = files_of(root);
        let named = named_paths(text);
        for f in &files {
            if !named
                .iter()
                .any(|n| n.ends_with(".rs") && ends_with_path(f, n))
            {
                out.push(format!(
                    "{root}/{f} is not in the code map's `{root}` section"
                ));
            }
        }
        for n in &named {
            let listed = if n.ends_with('/') { &dirs } else { &files };
            let here = listed
                .iter()
                .any(|p| ends_with_path(p, n.trim_end_matches('/')));
            let from_top = sections.iter().any(|(r, _)| n.trim_end_matches('/') == r)
                || sections.iter().any(|(r, _)| {
                    n.starts_with(&format!("{r}/")) && {
                        let rest = &n[r.len() + 1..];
                        let (f, d) = files_of(r);
                        let pool = if rest.ends_with('/') { d } else { f };
                        pool.iter().any(|p| p == rest.trim_end_matches('/'))
                    }
                });
            if !here && !from_top {
                out.push(format!(
                    "the code map's `{root}` section names {n}, which does not exist"
                ));
            }
        }
    }
    out
}

#[test]
fn the_code_map_rule_catches_a_missing_file_and_a_stale_name() {
    let arch = "# A\n## Code map\n### `crates/x` (`x`)\n- `lib.rs`: root. `gone.rs` was here; `sub/` and `sub/b.rs`.\n### How to\n`elsewhere.rs` is not checked\n## Invariants\n- `nothing.rs` here is not checked\n";
    let sections = code_map_sections(arch);
    assert_eq!(sections.len(), 1);
    let files = |_: &str| {
        (
            vec![
                "src/lib.rs".to_string(),
                "src/sub/b.rs".into(),
                "src/extra.rs".into(),
            ],
            vec!["src".to_string(), "src/sub".into()],
        )
    };
    let errors = code_map_errors(&sections, &files);
    assert_eq!(
        errors,
        [
            "crates/x/src/extra.rs is not in the code map's `crates/x` section",
            "the code map's `crates/x` section names gone.rs, which does not exist",
        ]
    );
}

#[test]
fn the_code_map_names_every_source_file_and_nothing_else() {
    let root = workspace_root();
    let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let sections = code_map_sections(&arch);
    assert!(sections.len() >= 8, "no code map sections found");
    let files_of = |section: &str| {
        let base = root.join(section);
        let rel = |p: &Path| {
            p.strip_prefix(&base)
                .unwrap_or(p)
                .to_string_lossy()
                .replace('\\', "/")
        };
        let files: Vec<String> = rust_files(&base)
            .iter()
            // Fuzz corpora and other data are not source.
            .filter(|p| !rel(p).starts_with("corpus/"))
            .map(|p| rel(p))
            .collect();
        let mut dirs: Vec<String> = files
            .iter()
            .flat_map(|f| {
                let parts: Vec<&str> = f.split('/').collect();
                (1..parts.len())
                    .map(move |i| parts[..i].join("/"))
                    .collect::<Vec<_>>()
            })
            .collect();
        dirs.sort();
        dirs.dedup();
        (files, dirs)
    };
    let errors = code_map_errors(&sections, &files_of);
    assert!(
        errors.is_empty(),
        "ARCHITECTURE.md's code map:\n{}",
        errors.join("\n")
    );
}

/// Where the workspace's `unsafe` code is, as ARCHITECTURE.md's invariant states it: (file,
/// the number of lines of code that say `unsafe`).
const UNSAFE_SITES: &[(&str, usize)] = &[
    // The GEMM call behind a checked safe wrapper, and `matmul_into`'s written slots.
    ("crates/models/src/gemm.rs", 2),
    // `written_chunks`, `written_chunks2`, `write_each`.
    ("crates/models/src/kernels.rs", 3),
    // `setpriority` and `getpriority` for the upload threads.
    ("crates/checkpoint/src/remote/mod.rs", 2),
    // The fuzz runner's allocation guard: the `GlobalAlloc` impl, its four methods and the
    // four calls into `System` they forward to.
    ("fuzz/src/guard.rs", 9),
    // The programs' allocator: the `GlobalAlloc` impl, its four methods, the four calls into
    // mimalloc they forward to, `getrlimit`, `write`, `getenv` with `mi_option_set`, and its
    // tests' calls.
    ("examples/src/allocator.rs", 14),
];

/// The lines of code (not comments or strings) of `text` that use the `unsafe` keyword.
fn unsafe_lines(text: &str) -> usize {
    text.lines()
        .filter(|l| !is_comment(l))
        .map(code_of)
        .filter(|c| {
            c.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
                .any(|w| w == "unsafe")
        })
        .count()
}

#[test]
fn the_unsafe_rule_counts_code_not_comments_names_or_strings() {
    let text = "// unsafe here is a comment\nlet s = \"unsafe\";\nfn unsafe_manifest() {}\n    unsafe { f() }\nunsafe impl X for Y {}\n";
    assert_eq!(unsafe_lines(text), 2);
}

#[test]
fn unsafe_code_is_where_the_architecture_says() {
    let root = workspace_root();
    let mut found: Vec<(String, usize)> = Vec::new();
    for dir in ["crates", "examples", "tests", "fuzz", "xtask", "benches"] {
        for f in rust_files(&root.join(dir)) {
            let n = unsafe_lines(&std::fs::read_to_string(&f).unwrap());
            if n > 0 {
                let rel = f
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                found.push((rel, n));
            }
        }
    }
    found.sort();
    let mut want: Vec<(String, usize)> = UNSAFE_SITES
        .iter()
        .map(|(f, n)| (f.to_string(), *n))
        .collect();
    want.sort();
    assert_eq!(
        found, want,
        "unsafe code moved: update UNSAFE_SITES and ARCHITECTURE.md's invariant together"
    );
}

/// A source file's module path in its crate (`trainer::step` for `trainer/step.rs` or
/// `trainer/step/mod.rs`); the crate root (`lib.rs`, `main.rs`) is `""`.
fn module_of(relative: &Path) -> String {
    let parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let parts: Vec<&str> = match parts.last().map(String::as_str) {
        Some("mod") => parts[..parts.len() - 1]
            .iter()
            .map(String::as_str)
            .collect(),
        Some("lib") | Some("main") if parts.len() == 1 => Vec::new(),
        _ => parts.iter().map(String::as_str).collect(),
    };
    parts.join("::")
}

/// The paths named after `crate::` (or `$crate::`) in `code`, braces expanded
/// (`crate::{a::X, b}` names `a::X` and `b`).
fn crate_paths(code: &str) -> Vec<String> {
    fn ident_path(s: &str) -> (String, &str) {
        let end = s
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(s.len());
        (s[..end].trim_end_matches(':').to_string(), &s[end..])
    }
    fn group(s: &str, prefix: &str, out: &mut Vec<String>) {
        // `s` starts after `{`; split at top-level commas up to the matching `}`.
        let mut depth = 0;
        let mut start = 0;
        for (i, c) in s.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    item(&s[start..i], prefix, out);
                    return;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    item(&s[start..i], prefix, out);
                    start = i + 1;
                }
                _ => {}
            }
        }
    }
    fn item(s: &str, prefix: &str, out: &mut Vec<String>) {
        let s = s.trim();
        let (path, rest) = ident_path(s);
        let full = if prefix.is_empty() {
            path.clone()
        } else if path.is_empty() {
            prefix.to_string()
        } else {
            format!("{prefix}::{path}")
        };
        match rest.trim_start().strip_prefix('{') {
            Some(inner) if s.contains("::{") => group(inner, &full, out),
            _ if !full.is_empty() && full != "self" => out.push(full),
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        // `krate::` or `some_crate::` is not the crate.
        let before = rest[..at].chars().last();
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            if let Some(inner) = after.strip_prefix('{') {
                group(inner, "", &mut out);
            } else {
                let (path, _) = ident_path(after);
                if !path.is_empty() {
                    out.push(path);
                }
            }
        }
        rest = after;
    }
    out
}

/// The modules a file's non-test code refers to by `crate::` paths: for each path, the longest
/// prefix that is one of `modules`, the root (`""`, a facade of re-exports) aside.
fn module_references(code: &str, me: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for path in crate_paths(code) {
        let parts: Vec<&str> = path.split("::").collect();
        let target = (1..=parts.len())
            .rev()
            .map(|k| parts[..k].join("::"))
            .find(|m| modules.contains(m));
        if let Some(t) = target {
            if t != me && !me.starts_with(&format!("{t}::")) && !t.starts_with(&format!("{me}::")) {
                out.insert(t);
            }
        }
    }
    out
}

/// The import circles among `files` (module path, text): each strongly connected group of
/// two or more modules, sorted. A module and its own submodules (`trainer` and
/// `trainer::step`) do not count as a circle: a folder module owns its files.
fn import_cycles(files: &[(String, String)]) -> Vec<Vec<String>> {
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in files {
        let text = text.split("#[cfg(test)]").next().unwrap_or_default();
        let code: String = text.lines().map(code_of).collect::<Vec<_>>().join("\n");
        edges.insert(m.clone(), module_references(&code, m, &modules));
    }
    // Tarjan's strongly connected components.
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<String, usize>,
        low: BTreeMap<String, usize>,
        stack: Vec<String>,
        on: BTreeSet<String>,
        out: Vec<Vec<String>>,
    }
    fn visit(w: &mut Walk<'_>, v: &str) {
        let i = w.index.len();
        w.index.insert(v.to_string(), i);
        w.low.insert(v.to_string(), i);
        w.stack.push(v.to_string());
        w.on.insert(v.to_string());
        let next: Vec<String> = w.edges[v].iter().cloned().collect();
        for n in next {
            if !w.edges.contains_key(&n) || n.is_empty() {
                continue;
            }
            if !w.index.contains_key(&n) {
                visit(w, &n);
                let l = w.low[&n].min(w.low[v]);
                w.low.insert(v.to_string(), l);
            } else if w.on.contains(&n) {
                let l = w.index[&n].min(w.low[v]);
                w.low.insert(v.to_string(), l);
            }
        }
        if w.low[v] == w.index[v] {
            let mut group = Vec::new();
            while let Some(x) = w.stack.pop() {
                w.on.remove(&x);
                let done = x == v;
                group.push(x);
                if done {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                w.out.push(group);
            }
        }
    }
    let mut w = Walk {
        edges: &edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for m in edges.keys() {
        if !m.is_empty() && !w.index.contains_key(m) {
            visit(&mut w, m);
        }
    }
    w.out
}

#[test]
fn the_import_circle_rule_catches_a_circle_and_nothing_else() {
    let files = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(m, t)| (m.to_string(), t.to_string()))
            .collect()
    };
    // a -> b -> c -> a through a braced use, a path in code and a re-export at the root.
    let circle = files(&[
        ("", "pub use a::X;\nmod a; mod b; mod c; mod d;"),
        ("a", "use crate::{b::{Y, Z}, Result};"),
        ("b", "fn f() { crate::c::g(); }"),
        ("c", "use crate::a::X; // crate::d::not_code"),
        (
            "d",
            "use crate::a::X;\n#[cfg(test)]\nmod tests { use crate::d::*; use crate::b::Y; }",
        ),
    ]);
    assert_eq!(import_cycles(&circle), [vec!["a", "b", "c"]]);
    // A folder module and its files, a `krate::` path and a comment are no circle.
    let none = files(&[
        ("trainer", "use crate::trainer::step::go;"),
        (
            "trainer::step",
            "use crate::trainer::Trainer; use crate::state::S;",
        ),
        (
            "state",
            "use my_krate::trainer::X; // use crate::trainer::Y",
        ),
    ]);
    assert!(
        import_cycles(&none).is_empty(),
        "{:?}",
        import_cycles(&none)
    );
    assert_eq!(module_of(Path::new("trainer/mod.rs")), "trainer");
    assert_eq!(module_of(Path::new("data/loader.rs")), "data::loader");
    assert_eq!(module_of(Path::new("lib.rs")), "");
}

#[test]
fn source_files_import_one_another_without_circles() {
    let root = workspace_root();
    let mut sources: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .expect("the crates folder")
        .flatten()
        .map(|e| e.path().join("src"))
        .collect();
    sources.extend([root.join("examples/src"), root.join("xtask/src")]);
    sources.sort();
    let mut problems = Vec::new();
    for src in sources.iter().filter(|s| s.is_dir()) {
        let files: Vec<(String, String)> = rust_files(src)
            .into_iter()
            .map(|p| {
                let rel = p.strip_prefix(src).expect("under its folder").to_path_buf();
                let text = std::fs::read_to_string(&p).expect("a readable source file");
                (module_of(&rel), text)
            })
            .collect();
        for group in import_cycles(&files) {
            problems.push(format!(
                "{}: {} import one another",
                src.strip_prefix(&root).unwrap_or(src).display(),
                group.join(", ")
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "import circles (move what both sides use into a module of its own):\n{}",
        problems.join("\n")
    );
}

/// The test filters of xtask's `GPU_SUBSET`, read from its source.
fn gpu_subset(source: &str) -> Vec<String> {
    let Some(start) = source.find("GPU_SUBSET: &[&str] = &[") else {
        return Vec::new();
    };
    let list = &source[start..];
    let list = &list[..list.find("];").unwrap_or(list.len())];
    list.split('"')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

#[test]
fn the_subset_reader_finds_each_filter() {
    let source = "const X: u8 = 1;\npub(crate) const GPU_SUBSET: &[&str] = &[\n    \"a::\",\n    \"b::c\",\n];\nconst Y: &str = \"d\";";
    assert_eq!(gpu_subset(source), ["a::", "b::c"]);
    assert!(gpu_subset("const Y: &str = \"d\";").is_empty());
}

/// The subset a GPU backend runs (`cargo xtask test --backend wgpu`) builds the test binary
/// alone: run here, on the CPU backend, with example programs forbidden, each of its filters
/// must match a test and every test it selects must pass. (A test that starts an example
/// program fails at once, naming the program.)
#[test]
fn the_gpu_subset_matches_tests_and_starts_no_example_program() {
    let source = std::fs::read_to_string(workspace_root().join("xtask/src/build.rs"))
        .expect("xtask's build.rs");
    let filters = gpu_subset(&source);
    assert!(filters.len() >= 10, "GPU_SUBSET not found: {filters:?}");
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let listed = std::process::Command::new(&exe)
        .args(["--list", "--format", "terse"])
        .output()
        .expect("the test binary lists its tests");
    let names: Vec<String> = String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test").map(String::from))
        .collect();
    let unmatched: Vec<&String> = filters
        .iter()
        .filter(|f| !names.iter().any(|n| n.contains(f.as_str())))
        .collect();
    assert!(
        unmatched.is_empty(),
        "GPU_SUBSET filters that match no test: {unmatched:?}"
    );
    let out = std::process::Command::new(&exe)
        .args(&filters)
        .env(crate::support::NO_EXAMPLE_PROGRAMS, "1")
        .output()
        .expect("the test binary runs");
    assert!(
        out.status.success(),
        "the GPU subset, run on this backend without example programs:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
