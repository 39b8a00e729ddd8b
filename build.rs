//! Parses and validates every `shaders/*.wgsl` with naga, each with `shaders/shared/prelude.wgsl`
//! (dtype codes, shared parameter structs) prepended (and the zeroing kernels with their shared loop,
//! `shaders/shared/zero_main.wgsl`, appended), reports all broken shaders at once with
//! `file:line:col`, and writes the table of shader sources to `OUT_DIR/shaders.rs`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::{env, fs};

use naga::valid::{Capabilities, ValidationFlags, Validator};

fn main() {
    // The manifest's directory when the script runs, not when it was compiled: cargo may reuse one
    // compiled script for another checkout of the same package.
    let root =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let dir = root.join("shaders");
    println!("cargo:rerun-if-changed={}", dir.display());
    let prelude_path = dir.join("shared").join("prelude.wgsl");
    println!("cargo:rerun-if-changed={}", prelude_path.display());
    let prelude = fs::read_to_string(&prelude_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", prelude_path.display()));
    let prelude_lines = prelude.lines().count();
    // Pass 1 of attention also takes how it finds rows (shared with the generated kernels).
    let rows_path = dir.join("shared").join("rows.wgsl");
    println!("cargo:rerun-if-changed={}", rows_path.display());
    let rows = fs::read_to_string(&rows_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", rows_path.display()));
    // The zeroing loop, shared by the zeroing kernels of 32-bit and of 64-bit words.
    let zero_main_path = dir.join("shared").join("zero_main.wgsl");
    println!("cargo:rerun-if-changed={}", zero_main_path.display());
    let zero_main = fs::read_to_string(&zero_main_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", zero_main_path.display()));

    let mut paths: Vec<PathBuf> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "wgsl"))
        .collect();
    paths.sort();

    let mut failures = Vec::new();
    let mut table =
        String::from("// Every WGSL shader of kvgpu, by file stem, validated by build.rs.\n");
    let mut layouts = String::new();
    let mut described = Vec::new();
    for path in &paths {
        println!("cargo:rerun-if-changed={}", path.display());
        let own = fs::read_to_string(path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("shader file name is UTF-8");
        let with_rows = stem == "attention_partial";
        let extra = if with_rows { rows.as_str() } else { "" };
        let zeroing = stem == "zero" || stem == "zero_int64";
        let after = if zeroing { zero_main.as_str() } else { "" };
        let source = format!("{prelude}{extra}{own}{after}");
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        let first = prelude_lines + extra.lines().count();
        let shown = format!(
            "{shown} (line numbers count the prelude{} first: {first} lines{})",
            if with_rows {
                " and shared/rows.wgsl"
            } else {
                ""
            },
            if zeroing {
                "; shared/zero_main.wgsl follows"
            } else {
                ""
            }
        );
        // Kernels named `*_int64` use 64-bit integers: the library builds them only on devices
        // with `wgpu::Features::SHADER_INT64`.
        let caps = if stem.ends_with("_int64") {
            Capabilities::SHADER_INT64
        } else {
            Capabilities::empty()
        };
        match validate(&source, &shown, caps) {
            Ok(module) => describe_structs(&module, &mut described, &mut layouts),
            Err(report) => failures.push(report),
        }
        let konst = stem.to_ascii_uppercase();
        let middle = if with_rows {
            format!("include_str!({:?}), ", rows_path.display().to_string())
        } else {
            String::new()
        };
        let last = if zeroing {
            format!(", include_str!({:?})", zero_main_path.display().to_string())
        } else {
            String::new()
        };
        writeln!(
            table,
            "pub(crate) const {konst}: &str = concat!(include_str!({:?}), {middle}include_str!({:?}){last});",
            prelude_path.display().to_string(),
            path.display().to_string()
        )
        .expect("writing to a String");
    }
    writeln!(
        table,
        "/// The shared prelude alone, for kernels generated at run time.\n\
         pub(crate) const PRELUDE: &str = include_str!({:?});\n\
         /// How pass 1 of attention finds rows, for kernels generated at run time.\n\
         pub(crate) const ROWS: &str = include_str!({:?});",
        prelude_path.display().to_string(),
        rows_path.display().to_string()
    )
    .expect("writing to a String");
    if !failures.is_empty() {
        for report in &failures {
            eprintln!("{report}");
        }
        panic!(
            "{} of {} shaders failed validation (reports above)",
            failures.len(),
            paths.len()
        );
    }
    writeln!(
        table,
        "/// `(struct, member, offset, struct size)` of every named WGSL struct member, as naga lays them out.\n\
         #[allow(dead_code)]\npub(crate) const WGSL_LAYOUTS: &[(&str, &str, u32, u32)] = &[\n{layouts}];"
    )
    .expect("writing to a String");
    let out = Path::new(&env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("shaders.rs");
    fs::write(&out, table).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// Appends `(struct, member, offset, size)` rows for every named struct of the module not described yet
/// (the prelude's structs appear in every module).
fn describe_structs(module: &naga::Module, described: &mut Vec<String>, out: &mut String) {
    let mut layouter = naga::proc::Layouter::default();
    layouter
        .update(module.to_ctx())
        .expect("a validated module has a layout");
    for (handle, ty) in module.types.iter() {
        if let (Some(name), naga::TypeInner::Struct { members, span }) = (&ty.name, &ty.inner) {
            if described.contains(name) {
                continue;
            }
            described.push(name.clone());
            for m in members {
                let member = m.name.as_deref().unwrap_or("");
                writeln!(out, "    ({name:?}, {member:?}, {}, {span}),", m.offset)
                    .expect("writing to a String");
            }
            debug_assert_eq!(layouter[handle].size, *span);
        }
    }
}

/// Parses and validates one shader, with the capabilities wgpu grants every device (packed 16-bit
/// float built-ins and pipeline-overridable constants need none), and `caps`.
fn validate(source: &str, path: &str, caps: Capabilities) -> Result<naga::Module, String> {
    let module = naga::front::wgsl::parse_str(source)
        .map_err(|e| e.emit_to_string_with_path(source, path))?;
    Validator::new(ValidationFlags::all(), caps)
        .validate(&module)
        .map(|_| module.clone())
        .map_err(|e| e.emit_to_string_with_path(source, path))
}
