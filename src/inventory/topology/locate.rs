//! Error locations: the line of a key path in the YAML text, for errors found after parsing.

/// One step of a key path such as `gpus[2].mig.devices[0].placement`.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

pub(super) fn steps(path: &str) -> Option<Vec<Step<'_>>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (key, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            out.push(Step::Key(key));
        }
        while let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            out.push(Step::Index(r[..end].parse().ok()?));
            rest = &r[end + 1..];
        }
    }
    Some(out)
}

/// The 1-based line of `path` in block-style YAML `text`, for errors found after parsing (serde
/// knows lines only while it parses). Follows keys and `- ` sequence items by indentation; a
/// step inside a flow collection (`{…}`, `[…]`) resolves to the line that holds it. `None` when
/// the text is laid out in a way this simple walk does not follow.
pub(super) fn locate(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let content = |l: &str| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#')
    };
    // The current node: lines [from, to) whose content is indented more than `parent`.
    let (mut from, mut to, mut parent) = (0usize, lines.len(), -1i64);
    let mut found: Option<usize> = None;
    for step in steps(path)? {
        if found
            .is_some_and(|l| lines[l].contains(['{', '[']) && !lines[l].trim_end().ends_with(':'))
        {
            // Inside a flow collection on this line: it is as precise as we get.
            break;
        }
        let hit = match step {
            Step::Key(k) => (from..to).find(|&i| {
                let l = lines[i];
                let t = l.trim_start().trim_start_matches("- ");
                content(l)
                    && indent(l) as i64 > parent
                    && (t.starts_with(&format!("{k}:")) || t.starts_with(&format!("{{{k}:")))
            }),
            Step::Index(n) => {
                let items: Vec<usize> = (from..to)
                    .filter(|&i| content(lines[i]) && lines[i].trim_start().starts_with("- "))
                    .collect();
                let first_indent = items.first().map(|&i| indent(lines[i]))?;
                items
                    .into_iter()
                    .filter(|&i| indent(lines[i]) == first_indent)
                    .nth(n)
            }
        };
        let line = match (hit, found) {
            (Some(l), _) => l,
            // A flow sequence (`key: [a, b]`) holds its items on the key's line.
            (None, Some(prev)) if matches!(step, Step::Index(_)) && lines[prev].contains('[') => {
                prev
            }
            _ => return None,
        };
        let own = indent(lines[line]);
        // The node ends at the next content line indented no deeper than this one (for a
        // sequence item, no deeper than its dash).
        let end = (line + 1..to)
            .find(|&i| content(lines[i]) && indent(lines[i]) <= own)
            .unwrap_or(to);
        from = line;
        to = end;
        parent = match step {
            Step::Index(_) => own as i64,
            // `- key:` starts a mapping whose keys sit deeper than the dash.
            Step::Key(_) => {
                let t = lines[line].trim_start();
                (own + t.len() - t.trim_start_matches("- ").len()) as i64
            }
        };
        found = Some(line);
    }
    found.map(|l| l + 1)
}
