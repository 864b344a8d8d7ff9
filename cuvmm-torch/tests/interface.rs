//! The C interface is declared once, in Rust (`src/ffi.rs` and `src/ffi/`, the `#[repr(C)]` structs of
//! `src/structs.rs`), and everything that restates it is checked against that here, so none can drift:
//! - `cuvmm_torch.h`: every exported function is declared with the same parameters and result, and nothing
//!   else; every struct has the same fields, of the same C types, in the same order; the function pointer
//!   types (the stream filter, the trace tracker) are the Rust ones;
//! - the C++ layer (`csrc/cuvmm_allocator.cpp`) calls through the header's declarations (`decltype`), so its
//!   table only has to name functions the header declares;
//! - the Python module's ctypes table (`python/cuvmm_torch/__init__.py`, `_declare`) names exported
//!   functions with the header's argument and result types.
//!
//! Rust is read with `syn`; the header and the two tables with small readers below (comments stripped,
//! declarations split at `;`). Types are compared as C spells them: Rust's `isize` is `ssize_t`,
//! `*mut c_void` is `void *` (or `cudaStream_t`, the header's name for a stream), `CDeviceStats` is
//! `cuvmm_device_stats`, and so on (`c_type`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use syn::{FnArg, Item, ReturnType, Type};

/// The function pointer types a C caller passes: the Rust type's name, the header's typedef.
const FN_POINTERS: [(&str, &str); 2] = [
    ("StreamFilterFn", "cuvmm_stream_filter"),
    ("TraceTrackerFn", "cuvmm_trace_tracker_fn"),
];

/// A function's parameters' C types and its result's.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    params: Vec<String>,
    result: String,
}

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable src/") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The C spelling of a Rust type of the interface; `None` for one the interface must not use.
fn c_type(ty: &Type) -> Option<String> {
    match ty {
        Type::Ptr(ptr) => {
            let pointee = c_type(&ptr.elem)?;
            let constness = if ptr.const_token.is_some() {
                "const "
            } else {
                ""
            };
            Some(format!("{constness}{pointee}*"))
        }
        Type::Path(path) => {
            let last = path.path.segments.last()?;
            let name = last.ident.to_string();
            let c = match name.as_str() {
                "c_void" => "void".to_string(),
                "c_char" => "char".to_string(),
                "c_int" | "i32" => "int".to_string(),
                "c_double" | "f64" => "double".to_string(),
                "isize" => "ssize_t".to_string(),
                "usize" => "size_t".to_string(),
                "u8" => "uint8_t".to_string(),
                "u32" => "uint32_t".to_string(),
                "i64" => "int64_t".to_string(),
                "u64" => "uint64_t".to_string(),
                "c_longlong" => "long long".to_string(),
                "c_ulonglong" => "unsigned long long".to_string(),
                _ if let Some((_, c)) = FN_POINTERS.iter().find(|(r, _)| *r == name) => {
                    (*c).to_string()
                }
                "Option" => {
                    // Option<fn> is a nullable function pointer: the type inside it.
                    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
                        return None;
                    };
                    let Some(syn::GenericArgument::Type(inner)) = args.args.first() else {
                        return None;
                    };
                    return c_type(inner);
                }
                other => struct_name(other)?,
            };
            Some(c)
        }
        Type::Tuple(t) if t.elems.is_empty() => Some("void".to_string()),
        _ => None,
    }
}

/// `CDeviceStats` -> `cuvmm_device_stats`: the header's name of a Rust mirror struct.
fn struct_name(rust: &str) -> Option<String> {
    let rest = rust.strip_prefix('C')?;
    if !rest.starts_with(|c: char| c.is_ascii_uppercase()) {
        return None;
    }
    let mut out = String::from("cuvmm");
    for c in rest.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    Some(out)
}

fn has_no_mangle(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        let text = quote_attr(a);
        text.contains("no_mangle")
    })
}

fn quote_attr(attr: &syn::Attribute) -> String {
    match &attr.meta {
        syn::Meta::Path(p) => path_text(p),
        syn::Meta::List(l) => format!("{}({})", path_text(&l.path), l.tokens),
        syn::Meta::NameValue(nv) => path_text(&nv.path),
    }
}

fn path_text(path: &syn::Path) -> String {
    (path.segments.iter())
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}

fn is_repr_c(attrs: &[syn::Attribute]) -> bool {
    attrs
        .iter()
        .any(|a| a.path().is_ident("repr") && quote_attr(a).contains('C'))
}

/// What the Rust sources declare: exported functions, `#[repr(C)]` structs (C name -> fields), and the
/// function pointer types of [`FN_POINTERS`] (C name -> signature).
struct RustInterface {
    functions: BTreeMap<String, Signature>,
    structs: BTreeMap<String, Vec<(String, String)>>,
    pointers: BTreeMap<String, Signature>,
}

fn bare_fn_signature(f: &syn::TypeBareFn) -> Signature {
    Signature {
        params: (f.inputs.iter())
            .map(|a| c_type(&a.ty).unwrap_or_else(|| panic!("an unknown type in {}", quote(&a.ty))))
            .collect(),
        result: match &f.output {
            ReturnType::Default => "void".to_string(),
            ReturnType::Type(_, ty) => c_type(ty).expect("a known result type"),
        },
    }
}

fn quote(ty: &Type) -> String {
    format!("{}", quote::ToTokens::to_token_stream(ty))
}

fn rust_interface() -> RustInterface {
    let mut files = Vec::new();
    rust_files(&crate_dir().join("src"), &mut files);
    let mut functions = BTreeMap::new();
    let mut structs = BTreeMap::new();
    let mut pointers = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable source");
        let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for item in parsed.items {
            match item {
                Item::Fn(f) if f.sig.abi.is_some() && has_no_mangle(&f.attrs) => {
                    let params = (f.sig.inputs.iter())
                        .map(|arg| match arg {
                            FnArg::Typed(t) => c_type(&t.ty).unwrap_or_else(|| {
                                panic!("{}: a type C does not know: {}", f.sig.ident, quote(&t.ty))
                            }),
                            FnArg::Receiver(_) => {
                                panic!("{}: a method cannot be exported", f.sig.ident)
                            }
                        })
                        .collect();
                    let result = match &f.sig.output {
                        ReturnType::Default => "void".to_string(),
                        ReturnType::Type(_, ty) => c_type(ty).unwrap_or_else(|| {
                            panic!(
                                "{}: a result type C does not know: {}",
                                f.sig.ident,
                                quote(ty)
                            )
                        }),
                    };
                    functions.insert(f.sig.ident.to_string(), Signature { params, result });
                }
                Item::Struct(s) if is_repr_c(&s.attrs) => {
                    let Some(name) = struct_name(&s.ident.to_string()) else {
                        continue;
                    };
                    let fields = (s.fields.iter())
                        .map(|field| {
                            let name = field.ident.as_ref().expect("named fields").to_string();
                            (name, c_type(&field.ty).unwrap_or_else(|| quote(&field.ty)))
                        })
                        .collect();
                    structs.insert(name, fields);
                }
                Item::Type(t) => {
                    if let (Type::BareFn(f), Some((_, c))) =
                        (&*t.ty, FN_POINTERS.iter().find(|(r, _)| t.ident == r))
                    {
                        pointers.insert((*c).to_string(), bare_fn_signature(f));
                    }
                }
                _ => {}
            }
        }
    }
    RustInterface {
        functions,
        structs,
        pointers,
    }
}

/// `text` without C comments.
fn strip_c_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("/*") {
            rest = after.find("*/").map_or("", |end| &after[end + 2..]);
            out.push(' ');
        } else if let Some(after) = rest.strip_prefix("//") {
            rest = after.find('\n').map_or("", |end| &after[end..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// A C declarator's type alone, normalized: `const char *path` -> `const char*`, `cudaStream_t stream` ->
/// `void*` (the header's stream type is an opaque pointer, as Rust's `*mut c_void`).
fn c_declared_type(declaration: &str) -> String {
    let declaration = declaration.replace('*', " * ");
    let mut words: Vec<&str> = declaration.split_whitespace().collect();
    // The last word is the name unless the declaration is a type alone (a `void` parameter list).
    if words.len() > 1 && words.last().is_some_and(|w| *w != "*") {
        words.pop();
    }
    // Words joined by spaces, then no space around `*`: `const char *` -> `const char*`.
    let out = words.join(" ");
    let out = out.replace(" *", "*").replace("* ", "*");
    match out.as_str() {
        "cudaStream_t" => "void*".to_string(),
        "const cudaStream_t" => "void*".to_string(),
        _ => out,
    }
}

/// What the header declares: functions, structs (typedef name -> fields) and function pointer typedefs.
struct Header {
    functions: BTreeMap<String, Signature>,
    structs: BTreeMap<String, Vec<(String, String)>>,
    pointers: BTreeMap<String, Signature>,
}

fn params_of(list: &str) -> Vec<String> {
    let list = list.trim();
    if list.is_empty() || list == "void" {
        return Vec::new();
    }
    list.split(',').map(c_declared_type).collect()
}

fn header() -> Header {
    let text = strip_c_comments(
        &std::fs::read_to_string(crate_dir().join("cuvmm_torch.h")).expect("the header"),
    );
    let mut functions = BTreeMap::new();
    let mut structs = BTreeMap::new();
    let mut pointers = BTreeMap::new();
    // Preprocessor lines and the extern "C" braces are not declarations.
    let body: String = (text.lines())
        .filter(|l| !l.trim_start().starts_with('#'))
        .collect::<Vec<_>>()
        .join("\n")
        .replace("extern \"C\" {", " ");
    let mut rest = body.as_str();
    while let Some(end) = rest.find(';') {
        let mut declaration = rest[..end].trim().to_string();
        rest = &rest[end + 1..];
        if declaration.starts_with("typedef struct {") || declaration.starts_with("typedef struct{")
        {
            // Fields up to the closing brace, then the name after it.
            let mut fields_text = declaration["typedef struct {".len()..].to_string();
            fields_text.push(';');
            loop {
                let close = rest.find('}');
                let next = rest.find(';');
                match (close, next) {
                    (Some(c), Some(n)) if c < n => {
                        fields_text.push_str(&rest[..c]);
                        let name_end = rest[c..].find(';').expect("a struct's name") + c;
                        let name = rest[c + 1..name_end].trim().to_string();
                        rest = &rest[name_end + 1..];
                        let mut fields = Vec::new();
                        for decl in fields_text
                            .split(';')
                            .map(str::trim)
                            .filter(|d| !d.is_empty())
                        {
                            // `uint64_t a, b, c` -> three fields of one type.
                            let mut parts = decl.split(',');
                            let first = parts.next().expect("a field");
                            let ty = c_declared_type(first);
                            let first_name = first
                                .replace('*', " ")
                                .split_whitespace()
                                .last()
                                .unwrap()
                                .to_string();
                            fields.push((first_name, ty.clone()));
                            for other in parts {
                                fields.push((other.trim().to_string(), ty.clone()));
                            }
                        }
                        structs.insert(name, fields);
                        break;
                    }
                    (_, Some(n)) => {
                        fields_text.push_str(&rest[..=n]);
                        rest = &rest[n + 1..];
                    }
                    _ => panic!("an unterminated struct in the header"),
                }
            }
            continue;
        }
        declaration = declaration.split_whitespace().collect::<Vec<_>>().join(" ");
        if let Some(pointer) = declaration.strip_prefix("typedef ")
            && let Some(open) = pointer.find("(*")
        {
            let result = c_declared_type(&format!("{} x", &pointer[..open]));
            let close = pointer[open..].find(')').expect("(*name)") + open;
            let name = pointer[open + 2..close].trim().to_string();
            let params = &pointer[close + 1..];
            let params = params.trim().trim_start_matches('(').trim_end_matches(')');
            pointers.insert(
                name,
                Signature {
                    params: params_of(params),
                    result,
                },
            );
            continue;
        }
        if declaration.starts_with("typedef ") || !declaration.contains('(') {
            continue;
        }
        let open = declaration.find('(').expect("a parameter list");
        let head = &declaration[..open];
        let name = head
            .replace('*', " ")
            .split_whitespace()
            .last()
            .expect("a name")
            .to_string();
        let result = c_declared_type(head);
        let params = &declaration[open + 1..declaration.rfind(')').expect("a closing parenthesis")];
        functions.insert(
            name,
            Signature {
                params: params_of(params),
                result,
            },
        );
    }
    Header {
        functions,
        structs,
        pointers,
    }
}

/// 64-bit integers the header may spell either way on the platforms cuvmm builds for.
fn same_c_type(a: &str, b: &str) -> bool {
    let canon = |t: &str| match t {
        "unsigned long long" => "uint64_t".to_string(),
        "long long" => "int64_t".to_string(),
        other => other.to_string(),
    };
    canon(a) == canon(b)
}

fn same_signature(a: &Signature, b: &Signature) -> bool {
    a.params.len() == b.params.len()
        && same_c_type(&a.result, &b.result)
        && a.params
            .iter()
            .zip(&b.params)
            .all(|(x, y)| same_c_type(x, y))
}

#[test]
fn the_header_declares_every_exported_function_as_rust_defines_it() {
    let rust = rust_interface();
    let header = header();
    assert!(
        rust.functions.len() > 30,
        "the exports were not read: {:?}",
        rust.functions.keys()
    );
    let mut report = Vec::new();
    for (name, sig) in &rust.functions {
        match header.functions.get(name) {
            None => report.push(format!("{name}: exported, not in cuvmm_torch.h")),
            Some(h) if !same_signature(sig, h) => {
                report.push(format!("{name}: Rust {sig:?}, cuvmm_torch.h {h:?}"))
            }
            Some(_) => {}
        }
    }
    for name in header.functions.keys() {
        if !rust.functions.contains_key(name) {
            report.push(format!("{name}: declared in cuvmm_torch.h, not exported"));
        }
    }
    assert!(
        report.is_empty(),
        "the header and ffi.rs disagree:\n{}",
        report.join("\n")
    );
}

#[test]
fn the_headers_structs_are_the_rust_mirrors_field_for_field() {
    let rust = rust_interface();
    let header = header();
    let mut report = Vec::new();
    for (name, fields) in &header.structs {
        match rust.structs.get(name) {
            None => report.push(format!(
                "{name}: in cuvmm_torch.h, no #[repr(C)] Rust struct"
            )),
            Some(r) => {
                let same = r.len() == fields.len()
                    && r.iter()
                        .zip(fields)
                        .all(|((rn, rt), (hn, ht))| rn == hn && same_c_type(rt, ht));
                if !same {
                    report.push(format!("{name}:\n  Rust   {r:?}\n  header {fields:?}"));
                }
            }
        }
    }
    for name in rust.structs.keys() {
        if !header.structs.contains_key(name) {
            report.push(format!(
                "{name}: a #[repr(C)] Rust struct the header does not declare"
            ));
        }
    }
    for (r, c) in FN_POINTERS {
        let ours = (rust.pointers.get(c)).unwrap_or_else(|| panic!("{r} is read"));
        let declared = (header.pointers.get(c)).unwrap_or_else(|| panic!("the header's {c}"));
        if !same_signature(ours, declared) {
            report.push(format!("{c}: Rust {ours:?}, header {declared:?}"));
        }
    }
    assert!(
        report.is_empty(),
        "the header's structs and structs.rs disagree:\n{}",
        report.join("\n")
    );
}

/// The names in the C++ layer's `CUVMM_REQUIRED` / `CUVMM_OPTIONAL` tables.
fn cpp_table() -> Vec<String> {
    let path = crate_dir().join("csrc/cuvmm_allocator.cpp");
    let text = std::fs::read_to_string(path).expect("the C++ layer");
    let mut names = Vec::new();
    for table in ["#define CUVMM_REQUIRED(X)", "#define CUVMM_OPTIONAL(X)"] {
        let start = text
            .find(table)
            .unwrap_or_else(|| panic!("{table} in the C++ layer"));
        let mut end = start;
        // The macro runs on while lines end with a backslash.
        for line in text[start..].lines() {
            end += line.len() + 1;
            if !line.trim_end().ends_with('\\') {
                break;
            }
        }
        let body = &text[start + table.len()..end];
        let mut rest = body;
        while let Some(at) = rest.find("X(") {
            let close = rest[at..].find(')').expect("X(name)") + at;
            names.push(rest[at + 2..close].trim().to_string());
            rest = &rest[close + 1..];
        }
    }
    names
}

#[test]
fn the_cpp_layer_names_only_functions_the_header_declares() {
    let header = header();
    let names = cpp_table();
    assert!(names.len() > 10, "the C++ tables were not read: {names:?}");
    let unknown: Vec<&String> = names
        .iter()
        .filter(|n| !header.functions.contains_key(*n))
        .collect();
    assert!(
        unknown.is_empty(),
        "the C++ layer names functions the header lacks: {unknown:?}"
    );
}

/// The ctypes table of the Python module: name -> (result, arguments) as ctypes spells them.
fn python_table() -> BTreeMap<String, (String, Vec<String>)> {
    let path = crate_dir().join("../python/cuvmm_torch/__init__.py");
    let text = std::fs::read_to_string(path).expect("the Python module");
    let start = text.find("signatures = {").expect("_declare's table");
    let end = text[start..].find("\n    }").expect("its end") + start;
    let mut table = BTreeMap::new();
    for line in text[start..end].lines().skip(1) {
        let line = line.trim();
        let Some(rest) = line.strip_prefix('"') else {
            continue;
        };
        let name_end = rest.find('"').expect("a quoted name");
        let name = rest[..name_end].to_string();
        let value = rest[name_end + 1..]
            .trim_start_matches(':')
            .trim()
            .trim_end_matches(',');
        // (restype, [argtypes])
        let value = value.trim_start_matches('(').trim_end_matches(')');
        let open = value.find('[').expect("an argument list");
        let result = value[..open]
            .trim()
            .trim_end_matches(',')
            .trim()
            .to_string();
        let args = value[open + 1..value.rfind(']').expect("]")]
            .split(',')
            .map(|a| a.trim().trim_start_matches("ctypes.").to_string())
            .filter(|a| !a.is_empty())
            .collect();
        table.insert(
            name,
            (result.trim_start_matches("ctypes.").to_string(), args),
        );
    }
    table
}

/// The ctypes types a C type may be declared with in the Python table.
fn ctypes_for(c: &str) -> &'static [&'static str] {
    match c {
        "void" => &["None"],
        "int" => &["c_int"],
        "ssize_t" => &["c_ssize_t"],
        "size_t" => &["c_size_t"],
        "double" => &["c_double"],
        "int64_t" | "long long" => &["c_int64", "c_longlong"],
        "uint64_t" | "unsigned long long" => &["c_uint64", "c_ulonglong"],
        // A string cuvmm hands out must be freed through its pointer, so c_void_p is right for `char*`
        // results; a `const char*` argument or result is text.
        "const char*" => &["c_char_p"],
        "char*" => &["c_void_p", "c_char_p"],
        c if c.ends_with('*') => &["c_void_p"],
        _ => &[],
    }
}

#[test]
fn the_python_table_declares_exported_functions_with_the_headers_types() {
    let header = header();
    let table = python_table();
    assert!(table.len() > 10, "the Python table was not read: {table:?}");
    let mut report = Vec::new();
    for (name, (result, args)) in &table {
        let Some(sig) = header.functions.get(name) else {
            report.push(format!("{name}: in the Python table, not in the header"));
            continue;
        };
        if !ctypes_for(&sig.result).contains(&result.as_str()) {
            report.push(format!(
                "{name}: result {result}, the header's is {}",
                sig.result
            ));
        }
        if args.len() != sig.params.len() {
            report.push(format!(
                "{name}: {} arguments, the header's {}",
                args.len(),
                sig.params.len()
            ));
            continue;
        }
        for (i, (arg, c)) in args.iter().zip(&sig.params).enumerate() {
            if !ctypes_for(c).contains(&arg.as_str()) {
                report.push(format!(
                    "{name}: argument {i} is {arg}, the header's is {c}"
                ));
            }
        }
    }
    assert!(
        report.is_empty(),
        "the Python table and the header disagree:\n{}",
        report.join("\n")
    );
}

/// The readers themselves: a planted difference is found (so the tests above can fail).
#[test]
fn the_readers_find_a_planted_difference() {
    let rust = rust_interface();
    let malloc = rust
        .functions
        .get("cuvmm_malloc")
        .expect("cuvmm_malloc is read");
    assert_eq!(malloc.params, ["ssize_t", "int", "void*"]);
    assert_eq!(malloc.result, "void*");
    let header = header();
    let declared = header.functions.get("cuvmm_malloc").expect("declared");
    assert!(same_signature(malloc, declared));
    let mut changed = declared.clone();
    changed.params[0] = "size_t".to_string();
    assert!(!same_signature(malloc, &changed));
    let stats = header
        .structs
        .get("cuvmm_device_stats")
        .expect("cuvmm_device_stats is read");
    assert_eq!(stats.first().map(|f| f.0.as_str()), Some("allocation"));
    assert_eq!(
        rust.structs.get("cuvmm_device_stats").map(Vec::len),
        Some(stats.len())
    );
    assert_eq!(struct_name("COomInfo").as_deref(), Some("cuvmm_oom_info"));
    assert_eq!(
        c_declared_type("const cuvmm_segment_info *segments"),
        "const cuvmm_segment_info*"
    );
    assert_eq!(
        c_declared_type("unsigned long long pool_a"),
        "unsigned long long"
    );
}
