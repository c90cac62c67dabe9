//! `nvdra validate`: every CEL expression of the objects given, compiled.

use super::*;

/// A CEL expression that does not compile, where it is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Problem {
    pub file: String,
    pub kind: String,
    pub name: String,
    /// e.g. `spec.devices.requests[0].exactly.selectors[1].cel.expression`
    pub path: String,
    pub line: Option<usize>,
    pub column: Option<usize>,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} {}: {}",
            self.file, self.kind, self.name, self.path
        )?;
        match (self.line, self.column) {
            (Some(l), Some(c)) if l > 1 => write!(f, ": line {l}, column {c}")?,
            (_, Some(c)) => write!(f, ": column {c}")?,
            _ => {}
        }
        write!(f, ": {}", self.message)
    }
}

/// Compiles every CEL expression of the classes and claims; what does not compile comes back.
pub fn validate(objects: &Objects) -> Vec<Problem> {
    let mut out = Vec::new();
    let mut check = |origin: &Origin, kind: &str, name: &str, path: String, s: &DeviceSelector| {
        let expr = s.cel.as_ref().map(|c| c.expression.as_str()).unwrap_or("");
        if let Err(e) = Selector::compile(expr) {
            let (line, column, message) = match &e {
                crate::cel::CompileError::Syntax {
                    line,
                    column,
                    message,
                } => (Some(*line), Some(*column), message.clone()),
                e => (None, e.column(), e.to_string()),
            };
            out.push(Problem {
                file: origin.file.display().to_string(),
                kind: kind.to_string(),
                name: name.to_string(),
                path,
                line,
                column,
                message,
            });
        }
    };
    for (c, origin) in &objects.classes {
        let name = c.metadata.name.clone().unwrap_or_default();
        for (i, s) in c.spec.selectors.iter().flatten().enumerate() {
            check(
                origin,
                "DeviceClass",
                &name,
                format!("spec.selectors[{i}].cel.expression"),
                s,
            );
        }
    }
    for claim in &objects.claims {
        let base = format!("{}.devices.requests", claim.spec_path);
        for (i, r) in claim
            .spec
            .devices
            .iter()
            .flat_map(|d| d.requests.iter().flatten())
            .enumerate()
        {
            if let Some(e) = &r.exactly {
                for (j, s) in e.selectors.iter().flatten().enumerate() {
                    let path = format!("{base}[{i}].exactly.selectors[{j}].cel.expression");
                    check(&claim.origin, claim.kind, &claim.name, path, s);
                }
            }
            for (k, sub) in r.first_available.iter().flatten().enumerate() {
                for (j, s) in sub.selectors.iter().flatten().enumerate() {
                    let path =
                        format!("{base}[{i}].firstAvailable[{k}].selectors[{j}].cel.expression");
                    check(&claim.origin, claim.kind, &claim.name, path, s);
                }
            }
        }
    }
    out
}
