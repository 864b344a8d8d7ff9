//! The workspace's structure, read from its sources: arrows between files run one way.
//!
//! Every file of every crate of the workspace is read (the library's `src/`, the laboratory's
//! `cuvmm-lab/src/` and its CLI `cuvmm-lab/src/bin/cuvmm/`, `cuvmm-torch/src/`); what a file names through
//! `use crate::…`, `use super::…`, `use self::…`, a child module's path, or a `crate::`/`super::` path in its
//! code is an arrow to the file that defines the item, followed through `pub use` re-exports. A `pub use`
//! of a child's item is the module's face, not a use: it is an arrow only if the file names the item
//! elsewhere. Comments and string literals are ignored.
//!
//! Checked:
//! - in every crate, no two files import each other, directly or round a longer cycle;
//! - in the library, no file imports a file of a higher layer (`LAYERS`, lowest first; docs/DESIGN.md's
//!   map). Between crates the arrows are Cargo's: the library depends on neither of the others.
//!
//! Each folder of the library's `src/` is a layer; a new folder must be given its layer in `LAYERS`.

mod common;

use common::source::{cycles, rust_files, strip};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The layers, lowest first: each file belongs to the first entry whose path prefix it has.
const LAYERS: &[(&str, &[&str])] = &[
    ("base", &["src/base/"]),
    ("driver seam", &["src/driver/"]),
    ("page map", &["src/page_map/"]),
    ("strategy interface", &["src/strategy/"]),
    ("strategies", &["src/expandable/"]),
    ("facade", &["src/facade/"]),
    ("crate root", &["src/lib.rs"]),
];

/// The crates of the workspace: the folder their module tree starts in (relative to the workspace root; the
/// root file is its `lib.rs` or `main.rs`), and folders under it that are other crates (the laboratory's
/// `bin/`).
const CRATES: &[(&str, &[&str])] = &[
    ("src", &[]),
    ("cuvmm-lab/src", &["bin/"]),
    ("cuvmm-lab/src/bin/cuvmm", &[]),
    ("cuvmm-torch/src", &[]),
];

/// A module path from the crate root (`["expandable", "segment"]`).
type ModPath = Vec<String>;

/// One source file as read.
struct File {
    /// Path relative to the crate root, with `/` separators.
    name: String,
    /// The code without comments and literals.
    code: String,
}

/// A `use` found in a file: the absolute path named, and, for a `pub use` at the file's top, the name
/// it is exported as.
struct Use {
    path: ModPath,
    exported_as: Option<String>,
}

/// The module path of a file named relative to its crate's folder: the root file (`lib.rs`, `main.rs`) is
/// the root, `a/mod.rs` and `a.rs` are `a`.
fn module_of(relative: &str) -> ModPath {
    let stem = relative.trim_end_matches(".rs");
    let mut segs: ModPath = stem.split('/').map(str::to_owned).collect();
    if segs == ["lib"] || segs == ["main"] || segs.last().is_some_and(|s| s == "mod") {
        segs.pop();
    }
    segs
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Whether `word` starts at byte `at` of `code` as a whole word.
fn word_at(code: &str, at: usize, word: &str) -> bool {
    code[at..].starts_with(word)
        && !code[..at].chars().next_back().is_some_and(is_ident)
        && !code[at + word.len()..].chars().next().is_some_and(is_ident)
}

/// The inline modules of a file (`mod name { … }`): byte range and name.
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (at, _) in code.match_indices("mod") {
        if !word_at(code, at, "mod") {
            continue;
        }
        let rest = &code[at + 3..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|&c| is_ident(c))
            .collect();
        if name.is_empty() {
            continue;
        }
        let after = rest.trim_start()[name.len()..].trim_start();
        if !after.starts_with('{') {
            continue;
        }
        let open = code.len() - after.len();
        let mut depth = 0;
        let mut end = open;
        for (j, &b) in bytes.iter().enumerate().skip(open) {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = j;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((at, end, name));
    }
    out
}

/// Splits a use tree (`a::{b, c::{d as e}}`) into paths, each with the name it brings in.
fn expand_tree(tree: &str) -> Vec<(String, String)> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let (path, alias) = match tree.split_once(" as ") {
            Some((p, a)) => (p.trim(), Some(a.trim())),
            None => (tree, None),
        };
        let name = alias.unwrap_or_else(|| path.rsplit("::").next().unwrap_or(path));
        return vec![(path.to_owned(), name.to_owned())];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.rfind('}').expect("a closing brace")];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (j, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..j]);
                start = j + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    let mut out = Vec::new();
    for part in parts.into_iter().filter(|p| !p.trim().is_empty()) {
        for (path, name) in expand_tree(part) {
            if path == "self" {
                let own = prefix.trim_end_matches("::");
                let name = own.rsplit("::").next().unwrap_or(own).to_owned();
                out.push((own.to_owned(), name));
            } else {
                out.push((format!("{prefix}{path}"), name));
            }
        }
    }
    out
}

/// The absolute module path a path names from inside module `scope`, or `None` for another crate's.
fn absolute(path: &str, scope: &[String], modules: &BTreeMap<ModPath, usize>) -> Option<ModPath> {
    let segs: Vec<&str> = path
        .split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let first = *segs.first()?;
    let mut base: ModPath = scope.to_vec();
    let mut rest = &segs[..];
    match first {
        "crate" | "$crate" => return Some(segs[1..].iter().map(|s| s.to_string()).collect()),
        "super" | "self" => {
            while let Some(&s) = rest.first() {
                match s {
                    "super" => {
                        base.pop();
                    }
                    "self" => {}
                    _ => break,
                }
                rest = &rest[1..];
            }
        }
        child => {
            let mut as_child = base.clone();
            as_child.push(child.to_owned());
            if !modules.contains_key(&as_child) {
                return None;
            }
        }
    }
    base.extend(rest.iter().map(|s| s.to_string()));
    Some(base)
}

/// The file that defines what `path` names: the longest module prefix that is a file, followed through
/// that file's re-exports.
fn resolve(
    path: &[String],
    modules: &BTreeMap<ModPath, usize>,
    exports: &[BTreeMap<String, ModPath>],
    depth: usize,
) -> Option<usize> {
    for k in (0..=path.len()).rev() {
        if let Some(&file) = modules.get(&path[..k]) {
            if let Some(next) = path.get(k)
                && depth < 16
                && let Some(target) = exports[file].get(next)
            {
                let mut full = target.clone();
                full.extend(path[k + 1..].iter().cloned());
                return resolve(&full, modules, exports, depth + 1).or(Some(file));
            }
            return Some(file);
        }
    }
    None
}

/// The layer of a file: its index in [`LAYERS`] and its name.
fn layer(name: &str) -> Option<(usize, &'static str)> {
    LAYERS
        .iter()
        .enumerate()
        .find_map(|(i, (layer, prefixes))| {
            prefixes
                .iter()
                .any(|p| name.starts_with(p))
                .then_some((i, *layer))
        })
}

/// Reads the library's `src/` and returns its files and the arrows between them (by index, self-arrows
/// left out).
fn graph() -> (Vec<File>, BTreeMap<usize, BTreeSet<usize>>) {
    graph_of(CRATES[0])
}

/// Reads one crate of [`CRATES`] and returns its files (named from the workspace root) and the arrows
/// between them.
fn graph_of(
    (folder, other_crates): (&str, &[&str]),
) -> (Vec<File>, BTreeMap<usize, BTreeSet<usize>>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(folder);
    let mut paths = Vec::new();
    rust_files(&dir, &mut paths);
    paths.sort();
    let mut files = Vec::new();
    let mut modules = BTreeMap::new();
    for path in paths {
        let relative = path
            .strip_prefix(&dir)
            .expect("under the crate's folder")
            .to_string_lossy()
            .replace('\\', "/");
        if other_crates.iter().any(|c| relative.starts_with(c)) {
            continue; // Another crate's.
        }
        modules.insert(module_of(&relative), files.len());
        let code = strip(&std::fs::read_to_string(&path).expect("readable source"));
        files.push(File {
            name: format!("{folder}/{relative}"),
            code,
        });
    }
    let module_paths: Vec<ModPath> = {
        let mut v = vec![ModPath::new(); files.len()];
        for (m, &i) in &modules {
            v[i] = m.clone();
        }
        v
    };

    let mut uses: Vec<Vec<Use>> = Vec::new();
    let mut exports: Vec<BTreeMap<String, ModPath>> = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let code = &file.code;
        let scopes = inline_modules(code);
        let scope_at = |at: usize| {
            let mut scope = module_paths[i].clone();
            for (start, end, name) in &scopes {
                if *start <= at && at < *end {
                    scope.push(name.clone());
                }
            }
            scope
        };
        let mut file_uses = Vec::new();
        let mut file_exports = BTreeMap::new();
        for (at, _) in code.match_indices("use") {
            if !word_at(code, at, "use") {
                continue;
            }
            let Some(len) = code[at..].find(';') else {
                continue;
            };
            let before = code[..at].trim_end();
            let public =
                before.ends_with("pub") || before.ends_with(')') && before.contains("pub(");
            let scope = scope_at(at);
            let at_top = scope == module_paths[i];
            for (path, name) in expand_tree(&code[at + 3..at + len]) {
                let Some(abs) = absolute(&path, &scope, &modules) else {
                    continue;
                };
                let exported_as = (public && at_top && name != "*").then_some(name);
                if let Some(name) = &exported_as {
                    file_exports.insert(name.clone(), abs.clone());
                }
                file_uses.push(Use {
                    path: abs,
                    exported_as,
                });
            }
        }
        for start in ["crate::", "super::", "self::"] {
            for (at, _) in code.match_indices(start) {
                if code[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| is_ident(c) || c == ':')
                {
                    continue;
                }
                let len = code[at..]
                    .find(|c: char| !(is_ident(c) || c == ':'))
                    .unwrap_or(code.len() - at);
                let path = code[at..at + len].trim_end_matches(':');
                if let Some(abs) = absolute(path, &scope_at(at), &modules) {
                    file_uses.push(Use {
                        path: abs,
                        exported_as: None,
                    });
                }
            }
        }
        uses.push(file_uses);
        exports.push(file_exports);
    }

    let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for (i, file_uses) in uses.iter().enumerate() {
        for u in file_uses {
            if let Some(name) = &u.exported_as {
                // A re-export is a use only if the file names the item besides.
                let code = &files[i].code;
                let named_elsewhere = code
                    .match_indices(name.as_str())
                    .filter(|&(at, _)| word_at(code, at, name))
                    .count()
                    > 1;
                if !named_elsewhere {
                    continue;
                }
            }
            if let Some(target) = resolve(&u.path, &modules, &exports, 0)
                && target != i
            {
                edges.entry(i).or_default().insert(target);
            }
        }
    }
    (files, edges)
}

#[test]
fn no_two_files_import_each_other_in_any_crate() {
    let mut report = String::new();
    for &krate in CRATES {
        let (files, edges) = graph_of(krate);
        assert!(files.len() > 3, "the sources of {} were not found", krate.0);
        for component in cycles(files.len(), &edges) {
            let members: BTreeSet<usize> = component.iter().copied().collect();
            report.push_str("cycle:\n");
            for &a in &members {
                for &b in edges[&a].intersection(&members) {
                    report.push_str(&format!("  {} -> {}\n", files[a].name, files[b].name));
                }
            }
        }
    }
    assert!(report.is_empty(), "files that import each other:\n{report}");
}

#[test]
fn no_file_imports_a_higher_layer() {
    let (files, edges) = graph();
    let mut report = String::new();
    for file in &files {
        if layer(&file.name).is_none() {
            report.push_str(&format!("{} has no layer: add it to LAYERS\n", file.name));
        }
    }
    for (&a, targets) in &edges {
        let Some((la, na)) = layer(&files[a].name) else {
            continue;
        };
        for &b in targets {
            if let Some((lb, nb)) = layer(&files[b].name)
                && lb > la
            {
                report.push_str(&format!(
                    "{} ({na}) imports {} ({nb})\n",
                    files[a].name, files[b].name
                ));
            }
        }
    }
    assert!(report.is_empty(), "arrows that run up:\n{report}");
}

/// The reader sees what it must: an arrow through a re-export lands on the defining file, and a planted
/// cycle is found (so the two tests above can fail).
#[test]
fn the_reader_finds_arrows_and_cycles() {
    let (files, edges) = graph();
    let index = |name: &str| {
        files
            .iter()
            .position(|f| f.name == name)
            .unwrap_or_else(|| panic!("{name} is read"))
    };
    // `use crate::driver::{…, DriverCounters, …}` in expandable/strategy.rs reaches counters.rs through
    // driver/mod.rs's `pub use counters::DriverCounters`.
    let from = index("src/expandable/strategy.rs");
    assert!(edges[&from].contains(&index("src/driver/counters.rs")));
    assert!(edges[&index("src/expandable/mod.rs")].contains(&index("src/strategy/pool.rs")));
    // Nothing below the strategies reaches into them.
    assert!(!edges[&index("src/strategy/stats.rs")].contains(&index("src/expandable/mod.rs")));

    let mut planted = edges.clone();
    let (a, b) = (
        index("src/strategy/stats.rs"),
        index("src/strategy/pool.rs"),
    );
    planted.entry(a).or_default().insert(b);
    planted.entry(b).or_default().insert(a);
    assert!(
        cycles(files.len(), &planted)
            .iter()
            .any(|c| c.contains(&a) && c.contains(&b))
    );
    assert_eq!(
        layer("src/expandable/segment.rs").map(|l| l.1),
        Some("strategies")
    );
    assert!(layer("src/strategy/stats.rs") < layer("src/expandable/mod.rs"));
    assert!(layer("src/lib.rs") > layer("src/facade/allocator.rs"));

    // The other crates are read as crates of their own: the CLI's modules from its `main.rs`.
    let (cli, cli_edges) = graph_of(CRATES[2]);
    let main = cli
        .iter()
        .position(|f| f.name.ends_with("bin/cuvmm/main.rs"));
    let main = main.expect("the CLI's main.rs is read");
    assert!(
        cli_edges.get(&main).is_some_and(|e| !e.is_empty()),
        "main.rs names its modules"
    );
    let (lab, _) = graph_of(CRATES[1]);
    assert!(
        lab.iter().all(|f| !f.name.contains("/bin/")),
        "the CLI is not the laboratory's library"
    );
}

/// Where stand-in streams may be opened: the laboratory's trace replays and experiments (`driver-bench`
/// among them), whose stream numbers name no stream of this process, the CLI, and the driver code that
/// defines them.
const STAND_IN_ALLOWED: &[&str] = &[
    "cuvmm-lab/src/replay/",
    "cuvmm-lab/src/experiments/",
    "cuvmm-lab/src/bin/",
    "src/driver/",
];

/// Every program-facing path (the library, cuvmm-torch, the examples) works on the
/// caller's streams: none opens a device with stand-in streams, where every wait for the program's work
/// would wait on an empty stream instead (the corruption of issue 29).
#[test]
fn no_program_facing_path_opens_stand_in_streams() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    for dir in ["src", "cuvmm-torch/src", "examples"] {
        rust_files(&root.join(dir), &mut paths);
    }
    assert!(paths.len() > 50, "the source tree was not found");
    let mut offenders = Vec::new();
    for path in paths {
        let name = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        if STAND_IN_ALLOWED.iter().any(|p| name.starts_with(p)) {
            continue;
        }
        let code = strip(&std::fs::read_to_string(&path).unwrap());
        for call in ["open_for_replay", "with_stand_in_streams"] {
            if code.contains(call) {
                offenders.push(format!("{name} calls {call}"));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "program-facing code opens stand-in streams: {offenders:?}"
    );
}
