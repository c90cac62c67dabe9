//! YAML in and out, for every file and output nvdra reads or writes as YAML (topology and
//! config files, the `--api-dir` directory, CDI specs, `nvdra inventory -o yaml|slices`).
//!
//! Invariant: what [`to_string`] writes reads back unchanged in a YAML 1.2 reader *and* in a
//! YAML 1.1 one (PyYAML, Go's yaml.v2, libyaml-based tools): a string that a 1.1 reader would
//! resolve to something else — the PCI address `0000:07:00.0` (base 60), `on`/`no`/`y`, `~`,
//! `1_000`, `0o17`, `2001-12-14`, `.inf`, `<<`, `=` — is written quoted. serde-saphyr does this
//! when its `yaml_12` option is off; [`to_string`] is the one place that sets it, and the tests
//! below and `tests/integration/yaml_readers.rs` (PyYAML) hold it to that.
//!
//! Reading is YAML 1.2, as before: a plain `yes` or `on` is a string, and a `bool` field takes
//! only `true`/`false`. Reading keeps serde's key path (`gpus[0].numaNode`) and the parser's line and column apart
//! from the message, so each caller words its error once.

use std::fmt;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_saphyr::MessageFormatter;

/// A value that cannot be written as YAML (a map with non-scalar keys, an unsupported type).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct WriteError(#[from] serde_saphyr::SerializeError);

/// A document that does not parse into the expected type.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ParseError {
    /// Where in the document, as serde spells it (`gpus[0].numaNode`); `.` for the root.
    pub path: String,
    /// 1-based line and column, where the parser knows them.
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// What is wrong, without the location.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        match (self.line, self.column) {
            (Some(l), Some(c)) => write!(f, " at line {l}, column {c}"),
            (Some(l), None) => write!(f, " at line {l}"),
            _ => Ok(()),
        }
    }
}

/// `value` as one YAML document (block style, no leading `---`).
pub fn to_string<T: Serialize>(value: &T) -> Result<String, WriteError> {
    let options = serde_saphyr::ser_options! {
        // Keep YAML 1.1 readers in mind: quote every string they would read as a bool, a
        // number, a null, a timestamp, a merge key or a value key.
        yaml_12: false,
        // One line per scalar: long strings are not folded, multi-line ones are escaped, so a
        // value stays greppable and nothing depends on the reader's folding rules.
        prefer_block_scalars: false,
    };
    Ok(serde_saphyr::to_string_with_options(value, options)?)
}

/// Parses one YAML document into `T`; unknown fields, wrong types and syntax errors come back
/// with the key path and the line and column.
pub fn from_str<T: DeserializeOwned>(text: &str) -> Result<T, ParseError> {
    // The path is known only inside the closure; the location is attached by the crate after.
    let mut path = None;
    let options = serde_saphyr::options! {
        // One-line messages; the caller names the file.
        with_snippet: false,
        // Read as YAML 1.2 (and as serde_yaml did): `yes`, `on`, `n` are strings, not booleans;
        // `0755` and `1_000` in untyped values (opaque claim parameters) stay strings.
        strict_booleans: true,
        leading_zero_numbers_as_strings: true,
        underscored_numbers_as_strings: true,
    };
    serde_saphyr::with_deserializer_from_str_with_options(text, options, |de| {
        serde_path_to_error::deserialize(de).map_err(|e| {
            path = Some(e.path().to_string());
            e.into_inner()
        })
    })
    .map_err(|e| parse_error(text, path.unwrap_or_else(|| ".".into()), &e))
}

fn parse_error(text: &str, path: String, e: &serde_saphyr::Error) -> ParseError {
    let e = e.without_snippet();
    let location = e.location();
    let known = |n: u64| usize::try_from(n).ok().filter(|&n| n > 0);
    let mut message = serde_saphyr::DefaultMessageFormatter
        .format_message(e)
        .into_owned();
    // "invalid u32" alone does not say what was found; the span does.
    if let serde_saphyr::Error::InvalidScalar { .. } = e
        && let Some(found) = location.and_then(|l| source_text(text, l.span()))
    {
        message.push_str(&format!(" {found:?}"));
    }
    ParseError {
        path,
        line: location.and_then(|l| known(l.line())),
        column: location.and_then(|l| known(l.column())),
        // The message can quote the input; keep it on one line.
        message: message
            .chars()
            .flat_map(|c| {
                let escaped: Vec<char> = if c.is_control() {
                    c.escape_default().collect()
                } else {
                    vec![c]
                };
                escaped
            })
            .collect(),
    }
}

/// The text a span covers, when it has byte offsets into `text`.
fn source_text(text: &str, span: serde_saphyr::Span) -> Option<&str> {
    let start = usize::try_from(span.byte_offset()?).ok()?;
    let len = usize::try_from(span.byte_len()?).ok()?;
    text.get(start..start.checked_add(len)?)
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;

    use super::*;

    /// Strings a YAML 1.1 or 1.2 reader would take for something else when written plain; shared
    /// with `tests/integration/yaml_readers.rs`, which has PyYAML read them.
    fn hostile() -> Vec<String> {
        serde_json::from_str(include_str!("../tests/data/yaml-hostile-strings.json")).unwrap()
    }

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Doc {
        values: Vec<String>,
        keys: BTreeMap<String, String>,
        nested: BTreeMap<String, Vec<Option<String>>>,
    }

    #[test]
    fn hostile_strings_round_trip_as_values_keys_and_in_nested_lists() {
        let values = hostile();
        let doc = Doc {
            keys: values.iter().map(|s| (s.clone(), s.clone())).collect(),
            nested: [(
                "list".to_string(),
                values.iter().cloned().map(Some).chain([None]).collect(),
            )]
            .into(),
            values,
        };
        let text = to_string(&doc).unwrap();
        let back: Doc = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back, doc, "{text}");
        let back: Doc = from_str(&text).unwrap();
        assert_eq!(back, doc);
    }

    /// Round trips alone would pass with a writer that leaves `on` plain and a reader that
    /// reads it back as a string (serde_yaml did exactly that); a YAML 1.1 reader would not.
    #[test]
    fn ambiguous_strings_are_quoted_and_ordinary_ones_are_not() {
        for s in hostile() {
            let text = to_string(&s).unwrap();
            let quoted = text.starts_with('\'') || text.starts_with('"');
            assert!(quoted, "{s:?} written as {text:?}");
        }
        for s in [
            "gpu-0",
            "80Gi",
            "H100-SXM5-80GB",
            "3g.40gb",
            "GPU-1f0c",
            "v1",
            "pci0000:1a",
        ] {
            assert_eq!(to_string(&s).unwrap(), format!("{s}\n"));
        }
    }

    #[test]
    fn reading_is_yaml_1_2() {
        let v: serde_json::Value =
            from_str("a: n\nb: on\nc: 0755\nd: 1_000\ne: true\nf: 7\n").unwrap();
        assert_eq!(
            v,
            serde_json::json!({"a": "n", "b": "on", "c": "0755", "d": "1_000", "e": true, "f": 7})
        );
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        struct Flag {
            on: bool,
        }
        let e = from_str::<Flag>("on: yes\n").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("on", Some(1)), "{e}");
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct Gpu {
        index: u32,
        numa_node: u32,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct File {
        gpus: Vec<Gpu>,
    }

    #[test]
    fn errors_carry_path_line_column_and_the_offending_value() {
        let e =
            from_str::<File>("gpus:\n  - index: 0\n    numaNode: 0\n  - index: 1\n    memry: 1\n")
                .unwrap_err();
        assert_eq!(
            (e.path.as_str(), e.line, e.column),
            ("gpus[1].memry", Some(5), Some(5))
        );
        assert!(e.message.starts_with("unknown field `memry`"), "{e}");
        assert!(e.to_string().ends_with(" at line 5, column 5"), "{e}");

        let e = from_str::<File>("gpus:\n  - index: 0\n    numaNode: zero\n").unwrap_err();
        assert_eq!((e.path.as_str(), e.line), ("gpus[0].numaNode", Some(3)));
        assert!(e.message.contains("\"zero\""), "{e}");

        let e = from_str::<File>("gpus:\n  - index: 0\n").unwrap_err();
        assert!(e.message.contains("missing field `numaNode`"), "{e}");

        let e = from_str::<File>("gpus: [\n").unwrap_err();
        assert_eq!(e.line, Some(1), "{e}");

        let e = from_str::<File>("gpus: []\nbad\u{1b}key: 1\n").unwrap_err();
        assert!(!e.message.contains('\u{1b}'), "{e}");
    }
}
