//! The modules' dependency graph, from the source: every `crate::…` and `super::…` path (in `use`
//! trees and inline alike) of every file of nvdra and of the kubelet-plugin library, read whole,
//! test code (each item marked `#[cfg(test)]`, and test modules in files of their own) left
//! out. It must have no circle — neither between files nor between top-level modules — and the
//! ledger must not import from `dra` (the ledger is below the DRA plugin that uses it).
//! A reader cannot see a circle in one file; this test sees all of them at once. The domain
//! modules (`inventory`, `ledger`, `holds`, `health`, `sharing`, `cdi`) must not name a
//! transport crate (`tonic`, `kube`): adapters depend on them, never the reverse.
//!
//! A path names the longest module it reaches (`crate::dra::slices::DeviceName` → `dra::slices`).
//! A module using its own ancestor or descendant is not a dependency here: a child uses its
//! parent's items and the parent declares the child, in every Rust crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Each file's module path, the module paths it refers to, and the transport crates it names.
struct Graph {
    modules: BTreeSet<Module>,
    edges: BTreeMap<Module, BTreeSet<Module>>,
    transports: BTreeMap<Module, BTreeSet<String>>,
}

/// The crates a domain module must not name: gRPC and the Kubernetes client.
const TRANSPORTS: [&str; 5] = [
    "tonic",
    "tonic_prost",
    "kube",
    "kube_client",
    "kube_runtime",
];

/// The modules that know nothing of gRPC or the API server (`DESIGN.md`'s parts table).
const DOMAIN: [&str; 6] = ["inventory", "ledger", "holds", "health", "sharing", "cdi"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut m: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        m.pop();
    }
    m
}

/// The code of a file without comments and strings.
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                let mut prev = ' ';
                for c in chars.by_ref() {
                    if prev == '*' && c == '/' {
                        break;
                    }
                    prev = c;
                }
                out.push(' ');
            }
            '"' => {
                let mut escaped = false;
                for c in chars.by_ref() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => break,
                        _ => escaped = false,
                    }
                }
                out.push_str("\"\"");
            }
            _ => out.push(c),
        }
    }
    out
}

/// Identifiers and the punctuation a path is made of.
fn tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = code.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_alphanumeric() || c == '_' {
            let mut ident = c.to_string();
            while let Some(&n) = chars.peek() {
                if n.is_alphanumeric() || n == '_' {
                    ident.push(n);
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(ident);
        } else if c == ':' && chars.peek() == Some(&':') {
            chars.next();
            out.push("::".into());
        } else if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    out
}

/// The tokens without the items marked `#[cfg(test)]` (tests may import freely): the attribute,
/// any attributes after it, and the item up to its `;` or through its brace-balanced body. The
/// code after a test module is read like any other.
fn without_test_items(tokens: Vec<String>) -> Vec<String> {
    const CFG_TEST: [&str; 7] = ["#", "[", "cfg", "(", "test", ")", "]"];
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        if !tokens[i..].starts_with(&CFG_TEST.map(String::from)) {
            out.push(tokens[i].clone());
            i += 1;
            continue;
        }
        i += CFG_TEST.len();
        // The item's head (`mod tests`, `use a::{b, c}`, `fn f() -> [u8; 4]`), up to the `;`
        // that ends it or the `{` of its body, outside brackets, parentheses and `use` trees.
        let mut nested = 0usize;
        let mut use_item = false;
        while let Some(t) = tokens.get(i) {
            i += 1;
            match t.as_str() {
                "use" => use_item = true,
                "(" | "[" => nested += 1,
                "{" if use_item => nested += 1,
                ")" | "]" | "}" if nested > 0 => nested -= 1,
                ";" if nested == 0 => break,
                "{" if nested == 0 => {
                    let mut depth = 1usize;
                    while depth > 0 && i < tokens.len() {
                        match tokens[i].as_str() {
                            "{" => depth += 1,
                            "}" => depth -= 1,
                            _ => {}
                        }
                        i += 1;
                    }
                    break;
                }
                _ => {}
            }
        }
    }
    out
}

/// The paths of a path or `use` tree starting at `tokens[i]` (after `crate::` or `super::`),
/// each prefixed by `base`.
fn paths(tokens: &[String], mut i: usize, base: Module, out: &mut Vec<Module>) -> usize {
    let mut path = base;
    loop {
        match tokens.get(i).map(String::as_str) {
            Some("{") => {
                i += 1;
                while tokens.get(i).is_some_and(|t| t != "}") {
                    if tokens[i] == "," {
                        i += 1;
                        continue;
                    }
                    i = paths(tokens, i, path.clone(), out);
                }
                return i + 1;
            }
            Some(t) if t.chars().all(|c| c.is_alphanumeric() || c == '_') => {
                path.push(t.to_string());
                i += 1;
                if tokens.get(i).map(String::as_str) == Some("::") {
                    i += 1;
                    continue;
                }
                out.push(path);
                return i;
            }
            _ => {
                out.push(path);
                return i;
            }
        }
    }
}

fn scan(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    let mut transports: BTreeMap<Module, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let module = module_of(src, file);
        // Test modules in files of their own.
        if module.iter().any(|s| s == "tests" || s.ends_with("_tests")) {
            continue;
        }
        let tokens = without_test_items(tokens(&code(&std::fs::read_to_string(file).unwrap())));
        // Inline `mod name { … }` blocks: (name, brace depth inside it).
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0;
        let mut referred = Vec::new();
        let mut i = 0;
        while i < tokens.len() {
            let t = tokens[i].as_str();
            let prev = if i > 0 { tokens[i - 1].as_str() } else { "" };
            match t {
                "{" => depth += 1,
                "}" => {
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                    depth -= 1;
                }
                "mod" if tokens.get(i + 2).is_some_and(|t| t == "{") => {
                    inline.push((tokens[i + 1].clone(), depth + 1));
                }
                "crate" | "super" if tokens.get(i + 1).is_some_and(|t| t == "::") => {
                    let mut here = module.clone();
                    here.extend(inline.iter().map(|(n, _)| n.clone()));
                    let mut base = if t == "crate" { Vec::new() } else { here };
                    let mut j = i;
                    if t == "super" {
                        while tokens.get(j).is_some_and(|t| t == "super")
                            && tokens.get(j + 1).is_some_and(|t| t == "::")
                        {
                            base.pop();
                            j += 2;
                        }
                    } else {
                        j += 2;
                    }
                    i = paths(&tokens, j, base, &mut referred);
                    continue;
                }
                // A path that starts at an external crate (`tonic::Status`, `use kube;`), not
                // a segment inside another path (`crate::api::kube`) or a field (`x.kube`).
                t if TRANSPORTS.contains(&t)
                    && !matches!(prev, "::" | ".")
                    && (prev == "use" || tokens.get(i + 1).is_some_and(|n| n == "::")) =>
                {
                    transports
                        .entry(module.clone())
                        .or_default()
                        .insert(t.to_string());
                }
                _ => {}
            }
            i += 1;
        }
        for path in referred {
            let Some(target) = (1..=path.len())
                .rev()
                .map(|k| path[..k].to_vec())
                .find(|p| modules.contains(p))
            else {
                continue;
            };
            let related = target.starts_with(&module) || module.starts_with(&target);
            if !related {
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    Graph {
        modules,
        edges,
        transports,
    }
}

/// `module → crate` for each transport crate a domain module names.
fn domain_transports(g: &Graph) -> Vec<String> {
    g.transports
        .iter()
        .filter(|(m, _)| m.first().is_some_and(|top| DOMAIN.contains(&top.as_str())))
        .flat_map(|(m, crates)| {
            crates
                .iter()
                .map(move |c| format!("{} → {c}", m.join("::")))
        })
        .collect()
}

/// The circles of a graph (its strongly connected components of more than one module).
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<String>> {
    // Tarjan's algorithm; the graphs are small.
    struct State<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'a Module, (usize, usize)>,
        stack: Vec<&'a Module>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Module) {
        s.index.insert(v, (s.next, s.next));
        s.next += 1;
        s.stack.push(v);
        let edges = s.edges;
        for w in edges.get(v).into_iter().flatten() {
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.index[w].1.min(s.index[v].1);
                s.index.get_mut(v).unwrap().1 = low;
            } else if s.stack.contains(&w) {
                let low = s.index[w].0.min(s.index[v].1);
                s.index.get_mut(v).unwrap().1 = low;
            }
        }
        if s.index[v].0 == s.index[v].1 {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                component.push(w.join("::"));
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.out.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: BTreeMap::new(),
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

/// The graph with each module folded into its top-level module.
fn top_level(g: &Graph) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut out: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (from, tos) in &g.edges {
        for to in tos {
            if from.first() != to.first() {
                out.entry(from[..1].to_vec())
                    .or_default()
                    .insert(to[..1].to_vec());
            }
        }
    }
    out
}

const CRATES: [&str; 2] = ["src", "crates/kubelet-plugin/src"];

fn graph(src: &str) -> Graph {
    scan(&Path::new(env!("CARGO_MANIFEST_DIR")).join(src))
}

#[test]
fn no_module_imports_in_a_circle() {
    for src in CRATES {
        let g = graph(src);
        assert!(g.modules.len() > 10, "{src}: only {:?}", g.modules);
        let files = circles(&g.edges);
        assert!(
            files.is_empty(),
            "{src}: modules import each other: {files:?}"
        );
        let top = circles(&top_level(&g));
        assert!(
            top.is_empty(),
            "{src}: top-level modules import each other: {top:?}"
        );
    }
}

#[test]
fn the_ledger_imports_nothing_from_dra() {
    let g = graph("src");
    let upward: Vec<String> = g
        .edges
        .iter()
        .filter(|(from, _)| from.first().is_some_and(|m| m == "ledger"))
        .flat_map(|(from, tos)| {
            tos.iter()
                .filter(|to| to.first().is_some_and(|m| m == "dra"))
                .map(move |to| format!("{} → {}", from.join("::"), to.join("::")))
        })
        .collect();
    assert!(upward.is_empty(), "the ledger imports from dra: {upward:?}");
    // The scan sees the ledger's real imports.
    assert!(g.edges[&vec!["ledger".to_string()]].contains(&vec!["durable".to_string()]));
}

#[test]
fn domain_modules_name_neither_tonic_nor_kube() {
    let g = graph("src");
    let found = domain_transports(&g);
    assert!(
        found.is_empty(),
        "domain modules name a transport crate (move that code to an adapter): {found:?}"
    );
    // The scan sees the transport crates where they belong.
    assert!(g.transports[&vec!["api".to_string(), "kube".to_string()]].contains("kube"));
    assert!(
        g.transports[&["deviceplugin", "server", "sockets"]
            .map(String::from)
            .to_vec()]
            .contains("tonic")
    );
}

/// The scanner itself, on a made-up crate: it finds `use` trees, inline paths, `super::` out of
/// an inline module, and ignores comments, strings and test code — but reads on after it.
#[test]
fn the_scan_finds_the_paths_a_reader_would() {
    let dir = tempfile::tempdir().unwrap();
    let write = |p: &str, s: &str| {
        let path = dir.path().join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, s).unwrap();
    };
    write("lib.rs", "mod a; mod b; mod c; mod d;");
    write(
        "a.rs",
        "use crate::{b::{self, X}, c};\n// crate::d::Y in a comment\nconst S: &str = \"crate::d\";\n",
    );
    write(
        "b.rs",
        "fn f() { let _ = crate::c::g(); }\n#[cfg(test)]\nmod t { use crate::a; }\n\
         #[cfg(test)]\nuse crate::{a::{self, N}, d};\n\
         #[cfg(test)]\n#[allow(dead_code)]\nfn t() -> [u8; 1] { crate::a::M }\n\
         fn h() -> u8 { crate::d::z() }\n",
    );
    write("c.rs", "mod inner { use super::super::d::Z; }\n");
    write("d.rs", "pub fn z() -> u8 { crate::a::N }\n");
    let g = scan(dir.path());
    let m = |s: &str| vec![s.to_string()];
    let set = |v: &[&str]| v.iter().map(|s| m(s)).collect::<BTreeSet<_>>();
    assert_eq!(g.edges[&m("a")], set(&["b", "c"]));
    // `d` from the code after the test items; `a` from none of them.
    assert_eq!(g.edges[&m("b")], set(&["c", "d"]));
    assert_eq!(g.edges[&m("c")], set(&["d"]));
    assert_eq!(g.edges[&m("d")], set(&["a"]));
    assert_eq!(circles(&g.edges), vec![vec!["a", "b", "c", "d"]]);
}

/// The transport check on a made-up crate: a planted `use tonic::…` in a domain module, and an
/// inline `kube::…` path in another, are found; a module of the same name inside another path,
/// a comment, test code and an adapter are not.
#[test]
fn a_domain_module_that_names_tonic_or_kube_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let write = |p: &str, s: &str| {
        let path = dir.path().join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, s).unwrap();
    };
    write("lib.rs", "mod api; mod inventory; mod ledger; mod sharing;");
    write("api/kube.rs", "use kube::Api;\n");
    write("inventory/mod.rs", "mod sim;\nuse tonic::Status;\n");
    write(
        "inventory/sim.rs",
        "use crate::api::kube::Client; // kube::Api\n",
    );
    write(
        "ledger.rs",
        "fn f() -> u8 { let _ = kube::Api::<()>::all; 0 }\n#[cfg(test)]\nmod t { use tonic::Code; }\n",
    );
    write("sharing.rs", "fn g(x: &X) -> u8 { x.kube }\n");
    let g = scan(dir.path());
    assert_eq!(
        domain_transports(&g),
        vec!["inventory → tonic".to_string(), "ledger → kube".to_string()]
    );
}
