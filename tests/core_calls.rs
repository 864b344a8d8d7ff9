//! The core's calls, read from `src/expandable/`: no two files of the core call each other's methods.
//!
//! The layering test (`tests/layering.rs`) sees imports; `impl Expandable` blocks spread over several files
//! call each other's methods without importing anything, so cycles between files of the core hide from it.
//! This test reads every `.rs` file under `src/expandable/` (comments, string and character literals
//! stripped; `#[cfg(test)] mod tests` and `tests.rs` files left out: tests may call anything), collects
//! each file's function definitions (`fn name`, with the type of the `impl` block around it, if any, and
//! whether that block implements a trait) and each call, and draws an arrow from a file to each file that
//! may define what it calls:
//! - `.name(` (a method call): every file with an inherent method `name`. Without types the receiver is
//!   unknown, so a name defined in several files is an arrow to each of them: the graph over-approximates,
//!   and a cycle it does not show is not there. Methods of trait impls (`Strategy`, `Drop`, `Iterator`,
//!   ...) are not targets: the core calls them through the trait from outside, and `.next(` or `.free(`
//!   on a std or foreign receiver would otherwise point at them. A core method named like a std one that a
//!   file calls on std receivers would draw false arrows from every file that uses a `Vec` or a map: a
//!   `.name(` call of a name in [`STD_NAMES`] (methods of std's collections, iterators, `Option`) is no
//!   arrow. The core's methods of those names are container operations (the free index's set operations,
//!   a block list's lookups); a core method that is more than that is named for what it does.
//! - `Type::name` (called or passed as a value) and `Self::name`: the files defining `name` in an `impl`
//!   of `Type` (of the `impl` around the call, for `Self`); a type the core does not define is no arrow.
//! - `name(` or `module::name` (a free function): every file with a free function `name`.
//!
//! An arrow from a file to itself is dropped. Checked: no two files call each other, and no longer cycle.
//! Checked besides: only the supply (`supply/`) creates, maps, unmaps or releases a handle.

mod common;

use common::source::{cycles, rust_files, strip};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// `code` without its `#[cfg(test)]` items (a test module, a test-only function).
fn without_tests(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        // The item ends at its closing brace (or at a `;` before any brace: `mod tests;`).
        let open = after.find('{');
        let semi = after.find(';');
        let end = match (open, semi) {
            (Some(o), Some(s)) if s < o => s + 1,
            (Some(o), _) => {
                let mut depth = 0;
                let mut end = after.len();
                for (i, c) in after[o..].char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                end = o + i + 1;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                end
            }
            (None, Some(s)) => s + 1,
            (None, None) => after.len(),
        };
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[derive(Clone, Debug, PartialEq)]
enum Token {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

fn tokens(code: &str) -> Vec<Token> {
    let chars: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push(Token::Ident(chars[start..i].iter().collect()));
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            out.push(Token::Path);
            i += 2;
        } else if c == '-' && chars.get(i + 1) == Some(&'>') {
            // `->`: not a closing angle bracket.
            out.push(Token::Punct('-'));
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push(Token::Punct(c));
            }
            i += 1;
        }
    }
    out
}

/// A function defined in a file: its name, the type of the `impl` around it (`None`: a free function),
/// and whether that `impl` implements a trait.
#[derive(Clone, Debug)]
struct Def {
    name: String,
    owner: Option<String>,
    trait_impl: bool,
}

/// Method names that std's collections, slices, iterators and `Option` define: `.name(` is no arrow.
const STD_NAMES: &[&str] = &[
    "new",
    "len",
    "is_empty",
    "get",
    "get_mut",
    "insert",
    "remove",
    "contains",
    "contains_key",
    "iter",
    "iter_mut",
    "push",
    "pop",
    "clear",
    "extend",
    "first",
    "last",
    "next",
    "find",
    "entry",
    "take",
    "replace",
    "retain",
    "sort",
    "drain",
    "map",
    "filter",
    "min",
    "max",
    "count",
    "sum",
    "any",
    "all",
    "position",
    "split_off",
    "truncate",
    "keys",
    "values",
    "as_ref",
    "as_mut",
    "clone",
    "default",
    "from",
    "into",
];

/// What a file calls.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Call {
    /// `.name(`
    Method(String),
    /// `Type::name`, `Self::name` resolved to the type.
    Path(String, String),
    /// `name(`, `module::name`
    Free(String),
}

fn ident(t: Option<&Token>) -> Option<&str> {
    match t {
        Some(Token::Ident(s)) => Some(s),
        _ => None,
    }
}

/// Skips a `<…>` group starting at `i` (which holds `<`); returns the index after it.
fn skip_angles(t: &[Token], mut i: usize) -> usize {
    let mut depth = 0;
    while i < t.len() {
        match t[i] {
            Token::Punct('<') => depth += 1,
            Token::Punct('>') => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// The type an `impl` header names (`impl<…> a::Type<…>` or `impl<…> Trait for Type<…>`), whether it
/// names a trait, and the index of the header's `{`.
fn impl_header(t: &[Token], mut i: usize) -> (String, bool, usize) {
    if t.get(i) == Some(&Token::Punct('<')) {
        i = skip_angles(t, i);
    }
    let mut name = String::new();
    let mut trait_impl = false;
    let mut depth = 0;
    while i < t.len() {
        match &t[i] {
            Token::Punct('{') if depth == 0 => break,
            Token::Punct('<') => depth += 1,
            Token::Punct('>') => depth -= 1,
            Token::Ident(s) if s == "for" && depth == 0 => {
                trait_impl = true;
                name.clear();
            }
            Token::Ident(s) if s == "where" && depth == 0 => {
                // Skip the where clause up to the block.
                while i < t.len() && t[i] != Token::Punct('{') {
                    i += 1;
                }
                break;
            }
            Token::Ident(s)
                if depth == 0 && s != "dyn" && (name.is_empty() || t[i - 1] == Token::Path) =>
            {
                name = s.clone();
            }
            _ => {}
        }
        i += 1;
    }
    (name, trait_impl, i)
}

/// The definitions and calls of one file's code.
fn read(code: &str) -> (Vec<Def>, BTreeSet<Call>) {
    let t = tokens(&without_tests(&strip(code)));
    let mut defs = Vec::new();
    let mut calls = BTreeSet::new();
    // Open blocks: the impl each one is (type, trait impl), if it is one.
    let mut blocks: Vec<Option<(String, bool)>> = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let current = blocks.iter().rev().flatten().next().cloned();
        match &t[i] {
            Token::Ident(s) if s == "impl" && ident(t.get(i.wrapping_sub(1))) != Some("dyn") => {
                // `impl Trait` in a type position has no block of its own: an impl item starts a line's
                // item, after `}`, `;`, an attribute's `]`, or at the file's start.
                let item = i == 0
                    || matches!(
                        t[i - 1],
                        Token::Punct('}') | Token::Punct(';') | Token::Punct(']')
                    )
                    || matches!(ident(t.get(i - 1)), Some("unsafe"));
                if item {
                    let (name, trait_impl, open) = impl_header(&t, i + 1);
                    blocks.push(Some((name, trait_impl)));
                    i = open + 1;
                    continue;
                }
            }
            Token::Punct('{') => blocks.push(None),
            Token::Punct('}') => {
                blocks.pop();
            }
            Token::Ident(s) if s == "fn" => {
                if let Some(name) = ident(t.get(i + 1)) {
                    defs.push(Def {
                        name: name.to_owned(),
                        owner: current.as_ref().map(|(ty, _)| ty.clone()),
                        trait_impl: current.as_ref().is_some_and(|&(_, tr)| tr),
                    });
                    i += 2;
                    continue;
                }
            }
            Token::Ident(name) => {
                let mut next = i + 1;
                if t.get(next) == Some(&Token::Path) && t.get(next + 1) == Some(&Token::Punct('<'))
                {
                    next = skip_angles(&t, next + 1);
                }
                let called = t.get(next) == Some(&Token::Punct('('));
                let lower = name
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_lowercase() || c == '_');
                let prev = t.get(i.wrapping_sub(1));
                if prev == Some(&Token::Punct('.')) && called {
                    if STD_NAMES.contains(&name.as_str()) {
                        i += 1;
                        continue;
                    }
                    calls.insert(Call::Method(name.clone()));
                } else if prev == Some(&Token::Path) && lower && t.get(i + 1) != Some(&Token::Path)
                {
                    match ident(t.get(i.wrapping_sub(2))) {
                        Some("Self") => {
                            if let Some((ty, _)) = &current {
                                calls.insert(Call::Path(ty.clone(), name.clone()));
                            }
                        }
                        Some(ty) if ty.chars().next().is_some_and(char::is_uppercase) => {
                            calls.insert(Call::Path(ty.to_owned(), name.clone()));
                        }
                        Some(_) => {
                            calls.insert(Call::Free(name.clone()));
                        }
                        None => {}
                    }
                } else if called && lower && prev != Some(&Token::Path) {
                    calls.insert(Call::Free(name.clone()));
                }
            }
            _ => {}
        }
        i += 1;
    }
    (defs, calls)
}

/// Method calls the reader cannot tell from a core method of the same name, each read by hand: (file,
/// method, what it calls). Only these are dropped; any other call of the name from that file still counts.
const NOT_CORE_CALLS: &[(&str, &str, &str)] = &[(
    "src/expandable/segment.rs",
    "page_size",
    "`self.pages.page_size()`, the page map's, not `Expandable::page_size`",
)];

/// The arrows between `files` (name, source): for each file, the files its calls may reach.
fn arrows(files: &[(String, String)]) -> BTreeMap<usize, BTreeSet<usize>> {
    let read: Vec<(Vec<Def>, BTreeSet<Call>)> = files.iter().map(|(_, src)| read(src)).collect();
    let mut edges: BTreeMap<usize, BTreeSet<usize>> = BTreeMap::new();
    for (from, (_, calls)) in read.iter().enumerate() {
        for call in calls {
            let not_core = |name: &str| {
                NOT_CORE_CALLS
                    .iter()
                    .any(|&(file, method, _)| files[from].0 == file && name == method)
            };
            if matches!(call, Call::Method(name) if not_core(name)) {
                continue;
            }
            for (to, (defs, _)) in read.iter().enumerate() {
                let defines = defs.iter().any(|d| match call {
                    Call::Method(name) => d.name == *name && d.owner.is_some() && !d.trait_impl,
                    Call::Path(ty, name) => d.name == *name && d.owner.as_deref() == Some(ty),
                    Call::Free(name) => d.name == *name && d.owner.is_none(),
                });
                if defines && to != from {
                    edges.entry(from).or_default().insert(to);
                }
            }
        }
    }
    edges
}

/// The core's files, as `(path from the crate root, source)`.
fn core_files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut paths = Vec::new();
    rust_files(&root.join("src/expandable"), &mut paths);
    paths.sort();
    paths
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n != "tests.rs"))
        .map(|p| {
            let name = p
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            (name, std::fs::read_to_string(&p).expect("readable source"))
        })
        .collect()
}

/// The pairs of files that call each other, by name.
fn mutual(files: &[(String, String)], edges: &BTreeMap<usize, BTreeSet<usize>>) -> Vec<String> {
    let mut out = Vec::new();
    for (&a, tos) in edges {
        for &b in tos {
            if a < b && edges.get(&b).is_some_and(|back| back.contains(&a)) {
                out.push(format!("{} <-> {}", files[a].0, files[b].0));
            }
        }
    }
    out
}

#[test]
fn no_two_files_of_the_core_call_each_other() {
    let files = core_files();
    let edges = arrows(&files);
    let pairs = mutual(&files, &edges);
    assert!(
        pairs.is_empty(),
        "{} pairs of files of the core call each other's methods:\n{}",
        pairs.len(),
        pairs.join("\n")
    );
}

#[test]
fn no_cycle_of_calls_between_files_of_the_core() {
    let files = core_files();
    let edges = arrows(&files);
    let found: Vec<String> = cycles(files.len(), &edges)
        .into_iter()
        .map(|c| {
            c.iter()
                .map(|&f| files[f].0.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "cycles of calls between files of the core:\n{}",
        found.join("\n")
    );
}

/// Physical memory is the supply's (`src/expandable/supply/`): no other file of the core creates, maps,
/// unmaps or releases a handle, so that a policy about physical memory has one part to act through. Memory
/// other processes shared is a part of its own with its own handles (`imports.rs`), and `settle.rs` holds the
/// settled forms of those calls.
#[test]
fn only_the_supply_creates_maps_unmaps_or_releases_handles() {
    const ACTS: &[&str] = &[
        "driver.create(",
        "driver.create_each(",
        "driver.map(",
        "driver.map_each(",
        "driver.map_from(",
        "driver.unmap(",
        "driver.release(",
        "unmap_settled(",
        "release_settled(",
        "undo_failed_map(",
    ];
    const OWNERS: &[&str] = &[
        "src/expandable/supply/",
        "src/expandable/imports.rs",
        "src/expandable/settle.rs",
    ];
    let mut found = Vec::new();
    for (name, src) in core_files() {
        if OWNERS.iter().any(|owner| name.starts_with(owner)) {
            continue;
        }
        let code: String = without_tests(&strip(&src))
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .replace("driver).", "driver.");
        found.extend(
            (ACTS.iter())
                .filter(|act| code.contains(*act))
                .map(|act| format!("{name}: {act}")),
        );
    }
    assert!(
        found.is_empty(),
        "handles acted on outside the supply:\n{}",
        found.join("\n")
    );
}

/// The reader on small files: a two-file cycle of method calls is found, a three-file one too, calls in
/// comments and strings and tests are not calls, and a std method of the same name as a trait impl's is
/// no arrow.
#[test]
fn the_reader_finds_call_cycles() {
    let file = |name: &str, src: &str| (name.to_owned(), src.to_owned());
    let pair = [
        file(
            "a.rs",
            "impl<D: Driver> Core<D> {\n fn grow(&mut self) { self.release(); }\n}",
        ),
        file(
            "b.rs",
            "impl<D> Core<D> where D: Driver {\n pub(super) fn release(&mut self) {\n if x { Self::grow(self) } }\n}",
        ),
    ];
    let edges = arrows(&pair);
    assert_eq!(mutual(&pair, &edges), ["a.rs <-> b.rs"]);
    assert_eq!(cycles(2, &edges).len(), 1);

    let ring = [
        file("a.rs", "impl A { fn one(&self) { Part::two(x) } }"),
        file("b.rs", "impl Part { fn two(x: u8) { three(x) } }"),
        file(
            "c.rs",
            "fn three(x: u8) { let y = foo.one(); }\nimpl Iterator for I { fn next(&mut self) {} }",
        ),
    ];
    let edges = arrows(&ring);
    assert!(mutual(&ring, &edges).is_empty());
    let mut ring_cycles = cycles(3, &edges);
    ring_cycles.iter_mut().for_each(|c| c.sort_unstable());
    assert_eq!(ring_cycles, [vec![0, 1, 2]]);

    let quiet = [
        file(
            "a.rs",
            "impl A { fn one(&self) { v.next(); } }\n// self.two()\n",
        ),
        file(
            "b.rs",
            "impl B { fn two(&self) { let s = \"self.one()\"; }\n}\n#[cfg(test)]\nmod tests { fn t() { x.one(); } }",
        ),
        file(
            "c.rs",
            "impl Iterator for I { fn next(&mut self) { a.two() } }",
        ),
    ];
    let edges = arrows(&quiet);
    assert!(cycles(3, &edges).is_empty(), "{edges:?}");
    assert_eq!(edges.get(&2), Some(&BTreeSet::from([1])));
    assert_eq!(edges.get(&0), None);
}
