//! The test API server's generic objects: every resource of [`RESOURCES`] that the typed code
//! (ResourceSlices, DeviceClasses, a claim's status apply) does not serve, stored as JSON, so
//! that controllers, daemons and plugins run against it through `kube::Client` (`kube::Api<T>`,
//! kube-runtime's watchers, its finalizer helper, its event recorder).
//!
//! Like the real server: get, list and watch (label selectors with `=`, `==`, `!=`, `in`,
//! `notin`, `k`, `!k`; field selectors on any dotted field, e.g. `metadata.name`,
//! `metadata.namespace`, `spec.nodeName`), watches from a resourceVersion replaying history, with
//! an object that stops or starts matching a selector sent as `DELETED` or `ADDED`, `BOOKMARK`s
//! when asked (`allowWatchBookmarks`, and the end of `sendInitialEvents`), 410 once compacted;
//! create (`generateName`, uid, creationTimestamp, generation, 409 `AlreadyExists`), update (409
//! `Conflict` on a stale resourceVersion; no-op updates store nothing), patch (JSON merge;
//! strategic merge treated as JSON merge, which is what it is for these kinds' maps and for
//! lists replaced whole; JSON patch; server-side apply as a merge of the fields given, which
//! needs a `fieldManager` and creates a missing object), delete (preconditions; finalizers: a
//! `deletionTimestamp` is set and the object stays until its finalizers are gone; then the
//! objects it owns (`ownerReferences` by uid) are deleted too, at once, as the garbage collector's
//! background propagation does eventually; `propagationPolicy: Orphan` keeps them), delete of a
//! collection, and the `/status` subresource (which writes only `status`; writes of the main
//! resource keep the stored status and bump `metadata.generation` when more than metadata
//! changes). API discovery (`/api`, `/apis`, `/api/v1`, `/apis/{group}/{version}`) lists them.
//!
//! Not like it: no admission, defaulting, schema validation or field ownership (managedFields);
//! deletion is immediate (no grace period); a list has no pages (`limit` ignored, no `continue`).

use super::{Body, State, error, now, ok_json, status_value, stream_response};
use hyper::StatusCode;
use hyper::body::Bytes;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use tokio::sync::mpsc;

/// A served resource: `apiVersion` (`v1`, `group/version`), plural, kind, namespaced, and
/// whether it has the `status` subresource.
pub(super) struct Resource {
    pub api: &'static str,
    pub plural: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub status: bool,
}

const fn r(
    api: &'static str,
    plural: &'static str,
    kind: &'static str,
    namespaced: bool,
    status: bool,
) -> Resource {
    Resource {
        api,
        plural,
        kind,
        namespaced,
        status,
    }
}

/// Every resource the generic store serves (a resource not here is a 404, as on a server that
/// does not have it). ResourceSlices and DeviceClasses are the typed code's.
pub(super) const RESOURCES: &[Resource] = &[
    r("v1", "pods", "Pod", true, true),
    r("v1", "nodes", "Node", false, true),
    r("v1", "namespaces", "Namespace", false, true),
    r("v1", "events", "Event", true, false),
    r("v1", "configmaps", "ConfigMap", true, false),
    r("v1", "secrets", "Secret", true, false),
    r("v1", "serviceaccounts", "ServiceAccount", true, false),
    r("apps/v1", "daemonsets", "DaemonSet", true, true),
    r("apps/v1", "deployments", "Deployment", true, true),
    r("coordination.k8s.io/v1", "leases", "Lease", true, false),
    r("events.k8s.io/v1", "events", "Event", true, false),
    r(
        "resource.k8s.io/v1",
        "resourceclaims",
        "ResourceClaim",
        true,
        true,
    ),
    r(
        "resource.k8s.io/v1",
        "resourceclaimtemplates",
        "ResourceClaimTemplate",
        true,
        false,
    ),
    r(
        "resource.nvidia.com/v1beta1",
        "computedomains",
        "ComputeDomain",
        true,
        true,
    ),
    r(
        "resource.nvidia.com/v1beta1",
        "computedomaincliques",
        "ComputeDomainClique",
        true,
        false,
    ),
];

/// The resource served at `api`/`plural`.
pub(super) fn resource(api: &str, plural: &str) -> Option<&'static Resource> {
    RESOURCES
        .iter()
        .find(|r| r.api == api && r.plural == plural)
}

fn group(api: &str) -> &str {
    api.rsplit_once('/').map_or("", |(g, _)| g)
}

/// `plural.group` (`pods` for the core group), as the API server names a resource in messages.
fn qualified(res: &Resource) -> String {
    match group(res.api) {
        "" => res.plural.to_string(),
        g => format!("{}.{g}", res.plural),
    }
}

/// A resource's key: (`apiVersion`, plural).
type ResKey = (&'static str, &'static str);

/// The generic objects, their change history and their watches.
#[derive(Default)]
pub(super) struct Objects {
    /// Per resource (`api`, plural), per (namespace, name): the object.
    store: BTreeMap<ResKey, BTreeMap<(String, String), Value>>,
    /// Every change since the last compaction.
    history: Vec<Change>,
    watchers: Vec<ObjWatcher>,
}

impl Objects {
    pub(super) fn forget_history(&mut self) {
        self.history.clear();
    }

    pub(super) fn close_watches(&mut self) {
        self.watchers.clear();
    }

    pub(super) fn get(&self, res: &Resource, ns: &str, name: &str) -> Option<&Value> {
        self.store
            .get(&(res.api, res.plural))?
            .get(&(ns.to_string(), name.to_string()))
    }

    pub(super) fn all(&self, res: &Resource) -> Vec<Value> {
        self.store
            .get(&(res.api, res.plural))
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }
}

/// A change, for watches from an earlier resourceVersion.
struct Change {
    rv: u64,
    res: (&'static str, &'static str),
    kind: &'static str,
    old: Option<Value>,
    new: Value,
}

struct ObjWatcher {
    res: (&'static str, &'static str),
    ns: Option<String>,
    sel: ObjSelector,
    tx: mpsc::UnboundedSender<Bytes>,
}

fn line(kind: &str, obj: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({ "type": kind, "object": obj })).expect("JSON serialises");
    line.push(b'\n');
    Bytes::from(line)
}

/// What a watch with `sel` sees of a change: an object that starts matching is `ADDED`, one that
/// stops is `DELETED`, as the real server's watch cache sends them.
fn seen(
    sel: &ObjSelector,
    kind: &'static str,
    old: Option<&Value>,
    new: &Value,
) -> Option<&'static str> {
    let now = sel.matches(new);
    let before = old.is_some_and(|o| sel.matches(o));
    match (kind, before, now) {
        ("MODIFIED", true, true) => Some("MODIFIED"),
        ("MODIFIED", true, false) => Some("DELETED"),
        ("MODIFIED", false, true) => Some("ADDED"),
        ("MODIFIED", false, false) => None,
        (k, _, true) => Some(k),
        _ => None,
    }
}

fn meta(obj: &Value, field: &str) -> Option<String> {
    obj.get("metadata")?.get(field)?.as_str().map(String::from)
}

fn key_of(obj: &Value) -> (String, String) {
    (
        meta(obj, "namespace").unwrap_or_default(),
        meta(obj, "name").unwrap_or_default(),
    )
}

fn set_meta(obj: &mut Value, field: &str, v: Value) {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"][field] = v;
}

fn finalizers_left(obj: &Value) -> bool {
    obj.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

/// Everything but `metadata` and `status`: what a change of bumps `metadata.generation`.
fn spec_part(obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("metadata");
        m.remove("status");
    }
    v
}

/// A random UID in the form the API server gives (a version 4 UUID).
fn uid() -> String {
    let b: [u8; 16] = rand::random();
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-4{}-a{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        &h[17..20],
        &h[20..32]
    )
}

fn not_found(res: &Resource, name: &str) -> Response {
    let details = json!({"name": name, "group": group(res.api), "kind": res.plural});
    let msg = format!("{} \"{name}\" not found", qualified(res));
    ok_json(
        StatusCode::NOT_FOUND,
        &status_value(404, "NotFound", &msg, Some(details)),
    )
}

fn conflict(res: &Resource, name: &str) -> Response {
    let details = json!({"name": name, "group": group(res.api), "kind": res.plural});
    let msg = format!(
        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please \
         apply your changes to the latest version and try again",
        qualified(res)
    );
    ok_json(
        StatusCode::CONFLICT,
        &status_value(409, "Conflict", &msg, Some(details)),
    )
}

type Response = hyper::Response<Body>;

/// A parsed request path of the generic store.
pub(super) struct Target {
    pub res: &'static Resource,
    /// The namespace in the path (None: cluster-scoped, or all namespaces).
    pub ns: Option<String>,
    pub name: Option<String>,
    /// `status`, when the path names the subresource.
    pub status: bool,
}

/// What a path under `/api` or `/apis` asks for.
pub(super) enum Path {
    /// `/api`, `/apis`, `/api/v1` or `/apis/{group}/{version}`.
    Discovery(Option<String>, bool),
    Target(Target),
    /// A path of no resource here, or a subresource other than `status`.
    Unknown,
}

pub(super) fn parse_path(segs: &[&str]) -> Path {
    let (api, rest) = match segs {
        ["api"] => return Path::Discovery(None, true),
        ["apis"] => return Path::Discovery(None, false),
        ["api", v, rest @ ..] => (v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return Path::Unknown,
    };
    let (ns, rest) = match rest {
        [] => return Path::Discovery(Some(api), false),
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        _ => (None, rest),
    };
    let (plural, name, status) = match rest {
        [plural] => (*plural, None, false),
        [plural, name] => (*plural, Some(name.to_string()), false),
        [plural, name, "status"] => (*plural, Some(name.to_string()), true),
        _ => return Path::Unknown,
    };
    let Some(res) = resource(&api, plural) else {
        return Path::Unknown;
    };
    // A namespaced resource is named with its namespace; only its collection is also served
    // across all of them. A cluster-scoped one has no namespace.
    let fits = match (&ns, &name, res.namespaced) {
        (Some(_), _, true) | (None, None, true) | (None, _, false) => true,
        (Some(_), _, false) | (None, Some(_), true) => false,
    };
    if !fits || (status && !res.status) {
        return Path::Unknown;
    }
    Path::Target(Target {
        res,
        ns,
        name,
        status,
    })
}

/// The discovery documents of the generic resources (`extra`: the typed code's, to list too).
pub(super) fn discovery(
    api: Option<&str>,
    core: bool,
    extra: &[(&str, &str, &str, bool)],
) -> Response {
    let mut rows: Vec<(&str, &str, &str, bool, bool)> = RESOURCES
        .iter()
        .map(|r| (r.api, r.plural, r.kind, r.namespaced, r.status))
        .collect();
    rows.extend(extra.iter().map(|(a, p, k, n)| (*a, *p, *k, *n, false)));
    match api {
        None if core => ok_json(
            StatusCode::OK,
            &json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}),
        ),
        None => {
            let mut groups: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (a, ..) in &rows {
                if let Some((g, v)) = a.split_once('/') {
                    let vs = groups.entry(g).or_default();
                    if !vs.contains(&v) {
                        vs.push(v);
                    }
                }
            }
            let groups: Vec<Value> = groups
                .iter()
                .map(|(g, vs)| {
                    let versions: Vec<Value> = vs
                        .iter()
                        .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                        .collect();
                    json!({"name": g, "versions": versions, "preferredVersion": versions[0]})
                })
                .collect();
            ok_json(
                StatusCode::OK,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}),
            )
        }
        Some(api) => {
            let mut resources = Vec::new();
            for (_, plural, kind, namespaced, status) in rows.iter().filter(|r| r.0 == api) {
                resources.push(json!({
                    "name": plural, "singularName": "", "namespaced": namespaced, "kind": kind,
                    "verbs": ["create", "delete", "deletecollection", "get", "list", "patch",
                              "update", "watch"],
                }));
                if *status {
                    resources.push(json!({
                        "name": format!("{plural}/status"), "singularName": "",
                        "namespaced": namespaced, "kind": kind, "verbs": ["get", "patch", "update"],
                    }));
                }
            }
            if resources.is_empty() {
                return error(
                    404,
                    "NotFound",
                    format!("the server could not find the requested resource ({api})"),
                );
            }
            ok_json(
                StatusCode::OK,
                &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": api,
                        "resources": resources}),
            )
        }
    }
}

/// A label and field selector over JSON objects.
#[derive(Clone, Debug, Default)]
pub(super) struct ObjSelector {
    /// (dotted field, value, equal?)
    fields: Vec<(String, String, bool)>,
    labels: Vec<(String, Req)>,
}

#[derive(Clone, Debug)]
enum Req {
    In(Vec<String>),
    NotIn(Vec<String>),
    Exists,
    NotExists,
}

/// Splits at the commas outside parentheses.
fn terms(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim());
    out.retain(|t| !t.is_empty());
    out
}

fn set_of(s: &str) -> Result<Vec<String>, String> {
    let inner = s
        .trim()
        .strip_prefix('(')
        .and_then(|s| s.strip_suffix(')'))
        .ok_or_else(|| format!("invalid label selector set {s:?}: want (a,b,...)"))?;
    Ok(inner.split(',').map(|v| v.trim().to_string()).collect())
}

impl ObjSelector {
    pub(super) fn parse(q: &BTreeMap<String, String>) -> Result<Self, String> {
        let mut sel = ObjSelector::default();
        for term in terms(q.get("fieldSelector").map_or("", String::as_str)) {
            let (f, v, eq) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = term.split_once('=') {
                (f, v, true)
            } else {
                return Err(format!("invalid field selector term {term:?}"));
            };
            sel.fields.push((f.trim().into(), v.trim().into(), eq));
        }
        for term in terms(q.get("labelSelector").map_or("", String::as_str)) {
            let req = if let Some((k, v)) = term.split_once(" notin ") {
                (k, Req::NotIn(set_of(v)?))
            } else if let Some((k, v)) = term.split_once(" in ") {
                (k, Req::In(set_of(v)?))
            } else if let Some((k, v)) = term.split_once("!=") {
                (k, Req::NotIn(vec![v.trim().into()]))
            } else if let Some((k, v)) = term.split_once("==") {
                (k, Req::In(vec![v.trim().into()]))
            } else if let Some((k, v)) = term.split_once('=') {
                (k, Req::In(vec![v.trim().into()]))
            } else if let Some(k) = term.strip_prefix('!') {
                (k, Req::NotExists)
            } else {
                (term, Req::Exists)
            };
            sel.labels.push((req.0.trim().into(), req.1));
        }
        Ok(sel)
    }

    pub(super) fn matches(&self, obj: &Value) -> bool {
        let fields = self.fields.iter().all(|(f, v, eq)| {
            let mut cur = obj;
            for part in f.split('.') {
                cur = cur.get(part).unwrap_or(&Value::Null);
            }
            let actual = match cur {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            (actual == *v) == *eq
        });
        let labels = obj.pointer("/metadata/labels");
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        fields
            && self.labels.iter().all(|(k, req)| match req {
                Req::In(vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
                Req::NotIn(vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
                Req::Exists => label(k).is_some(),
                Req::NotExists => label(k).is_none(),
            })
    }
}

impl State {
    /// Stores `new` (None: removes the object `old`), moving the resourceVersion on and telling
    /// history and watches. An object marked for deletion whose finalizers are gone is removed,
    /// and with it what it owns.
    pub(super) fn obj_commit(
        &mut self,
        res: &'static Resource,
        old: Option<Value>,
        new: Option<Value>,
    ) -> Option<Value> {
        let mut new = new;
        if let Some(n) = &new
            && n.pointer("/metadata/deletionTimestamp").is_some()
            && !finalizers_left(n)
        {
            // The last finalizer went: the object goes.
            return self.obj_remove(res, new.take().expect("checked"), true);
        }
        let Some(mut n) = new else {
            return old.and_then(|o| self.obj_remove(res, o, true));
        };
        let rv = self.next_rv();
        set_meta(&mut n, "resourceVersion", rv.to_string().into());
        let kind = if old.is_some() { "MODIFIED" } else { "ADDED" };
        self.objects
            .store
            .entry((res.api, res.plural))
            .or_default()
            .insert(key_of(&n), n.clone());
        self.obj_emit(res, kind, old, n.clone());
        Some(n)
    }

    /// Removes an object for good (DELETED), then, with `cascade`, the objects that name it as
    /// an owner (each with the same finalizer rule).
    fn obj_remove(&mut self, res: &'static Resource, obj: Value, cascade: bool) -> Option<Value> {
        let key = key_of(&obj);
        let mut gone = self
            .objects
            .store
            .get_mut(&(res.api, res.plural))
            .and_then(|m| m.remove(&key))?;
        let rv = self.next_rv();
        set_meta(&mut gone, "resourceVersion", rv.to_string().into());
        self.obj_emit(res, "DELETED", None, gone.clone());
        if cascade && let Some(uid) = meta(&gone, "uid") {
            let owned: Vec<(&'static Resource, Value)> = RESOURCES
                .iter()
                .flat_map(|r| self.objects.all(r).into_iter().map(move |o| (r, o)))
                .filter(|(_, o)| {
                    o.pointer("/metadata/ownerReferences")
                        .and_then(Value::as_array)
                        .is_some_and(|refs| refs.iter().any(|r| r["uid"].as_str() == Some(&uid)))
                })
                .collect();
            for (r, o) in owned {
                self.obj_delete(r, o);
            }
        }
        Some(gone)
    }

    /// A delete: marks an object with finalizers, removes any other.
    pub(super) fn obj_delete(&mut self, res: &'static Resource, obj: Value) -> Option<Value> {
        if finalizers_left(&obj) {
            if obj.pointer("/metadata/deletionTimestamp").is_some() {
                return Some(obj);
            }
            let mut marked = obj.clone();
            set_meta(&mut marked, "deletionTimestamp", json!(now()));
            set_meta(&mut marked, "deletionGracePeriodSeconds", json!(0));
            return self.obj_commit(res, Some(obj), Some(marked));
        }
        self.obj_remove(res, obj, true)
    }

    fn obj_emit(
        &mut self,
        res: &'static Resource,
        kind: &'static str,
        old: Option<Value>,
        new: Value,
    ) {
        let rv = self.rv;
        let key = (res.api, res.plural);
        let ns = meta(&new, "namespace").unwrap_or_default();
        self.objects.watchers.retain(|w| {
            if w.res != key || w.ns.as_ref().is_some_and(|n| *n != ns) {
                return !w.tx.is_closed();
            }
            match seen(&w.sel, kind, old.as_ref(), &new) {
                Some(k) => w.tx.send(line(k, &new)).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
        self.objects.history.push(Change {
            rv,
            res: key,
            kind,
            old,
            new,
        });
    }

    /// Stores an object as someone else would (any field, status included): created or
    /// replaced whole, with the metadata the server owns filled in.
    pub(super) fn obj_put(&mut self, res: &'static Resource, mut obj: Value) -> Value {
        obj["apiVersion"] = res.api.into();
        obj["kind"] = res.kind.into();
        let key = key_of(&obj);
        let old = self.objects.get(res, &key.0, &key.1).cloned();
        for (field, default) in [
            ("uid", json!(uid())),
            ("creationTimestamp", json!(now())),
            ("generation", json!(1)),
        ] {
            let kept = old.as_ref().and_then(|o| o["metadata"].get(field).cloned());
            if obj.pointer(&format!("/metadata/{field}")).is_none() {
                set_meta(&mut obj, field, kept.unwrap_or(default));
            }
        }
        self.obj_commit(res, old, Some(obj))
            .expect("a stored object")
    }

    /// GET of one object or a list, and watches.
    pub(super) fn obj_read(&mut self, t: &Target, q: &BTreeMap<String, String>) -> Response {
        let res = t.res;
        if let Some(name) = &t.name {
            let ns = t.ns.clone().unwrap_or_default();
            return match self.objects.get(res, &ns, name) {
                Some(o) => ok_json(StatusCode::OK, o),
                None => not_found(res, name),
            };
        }
        let sel = match ObjSelector::parse(q) {
            Ok(s) => s,
            Err(e) => return error(400, "BadRequest", e),
        };
        let in_ns = |o: &Value| {
            t.ns.as_ref()
                .is_none_or(|n| meta(o, "namespace").as_deref() == Some(n.as_str()))
        };
        let current: Vec<Value> = self
            .objects
            .all(res)
            .into_iter()
            .filter(|o| in_ns(o) && sel.matches(o))
            .collect();
        let flag = |k: &str| q.get(k).is_some_and(|w| w == "true" || w == "1");
        if !flag("watch") {
            return ok_json(
                StatusCode::OK,
                &json!({
                    "apiVersion": res.api, "kind": format!("{}List", res.kind),
                    "metadata": {"resourceVersion": self.rv.to_string()},
                    "items": current,
                }),
            );
        }
        let (tx, rx) = mpsc::unbounded_channel::<Bytes>();
        let bookmark = |rv: u64, end: bool| {
            let mut m = json!({"resourceVersion": rv.to_string()});
            if end {
                m["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            }
            line(
                "BOOKMARK",
                &json!({"apiVersion": res.api, "kind": res.kind, "metadata": m}),
            )
        };
        let from = q.get("resourceVersion").cloned().unwrap_or_default();
        if flag("sendInitialEvents") {
            for o in &current {
                let _ = tx.send(line("ADDED", o));
            }
            let _ = tx.send(bookmark(self.rv, true));
        } else if from.is_empty() || from == "0" {
            for o in &current {
                let _ = tx.send(line("ADDED", o));
            }
        } else {
            let Ok(rv) = from.parse::<u64>() else {
                return error(
                    400,
                    "BadRequest",
                    format!("invalid resourceVersion {from:?}: want a number the server gave"),
                );
            };
            if rv < self.compacted {
                let status = status_value(
                    410,
                    "Expired",
                    &format!("too old resource version: {rv} ({})", self.compacted),
                    None,
                );
                let _ = tx.send(line("ERROR", &status));
                drop(tx);
                return stream_response(rx);
            }
            for c in self
                .objects
                .history
                .iter()
                .filter(|c| c.rv > rv && c.res == (res.api, res.plural) && in_ns(&c.new))
            {
                if let Some(k) = seen(&sel, c.kind, c.old.as_ref(), &c.new) {
                    let _ = tx.send(line(k, &c.new));
                }
            }
        }
        if flag("allowWatchBookmarks") && !flag("sendInitialEvents") {
            let _ = tx.send(bookmark(self.rv, false));
        }
        self.objects.watchers.push(ObjWatcher {
            res: (res.api, res.plural),
            ns: t.ns.clone(),
            sel,
            tx,
        });
        stream_response(rx)
    }

    /// POST: a create.
    pub(super) fn obj_create(&mut self, t: &Target, body: &[u8]) -> Response {
        let res = t.res;
        let mut obj: Value = match serde_json::from_slice(body) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => return error(400, "BadRequest", "the body is not a JSON object"),
            Err(e) => return error(400, "BadRequest", format!("decoding the body: {e}")),
        };
        let ns = t.ns.clone().unwrap_or_default();
        if let Some(have) = meta(&obj, "namespace")
            && !have.is_empty()
            && have != ns
        {
            return error(
                400,
                "BadRequest",
                format!(
                    "the namespace of the provided object ({have}) does not match the namespace sent on the request ({ns})"
                ),
            );
        }
        let name = match (meta(&obj, "name"), meta(&obj, "generateName")) {
            (Some(n), _) if !n.is_empty() => n,
            (_, Some(prefix)) if !prefix.is_empty() => loop {
                let base: String = prefix.chars().take(58).collect();
                let suffix: String = (0..5)
                    .map(|_| {
                        let a = super::NAME_ALPHABET;
                        char::from(a[rand::random_range(0..a.len())])
                    })
                    .collect();
                let name = format!("{base}{suffix}");
                if self.objects.get(res, &ns, &name).is_none() {
                    break name;
                }
            },
            _ => {
                return error(
                    422,
                    "Invalid",
                    format!(
                        "{} \"\" is invalid: metadata.name: Required value: name or generateName is required",
                        res.kind
                    ),
                );
            }
        };
        if self.objects.get(res, &ns, &name).is_some() {
            let details = json!({"name": name, "group": group(res.api), "kind": res.plural});
            let msg = format!("{} \"{name}\" already exists", qualified(res));
            return ok_json(
                StatusCode::CONFLICT,
                &status_value(409, "AlreadyExists", &msg, Some(details)),
            );
        }
        if res.status
            && let Some(m) = obj.as_object_mut()
        {
            m.remove("status");
        }
        set_meta(&mut obj, "name", name.into());
        if res.namespaced {
            set_meta(&mut obj, "namespace", ns.into());
        }
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "resourceVersion",
        ] {
            if let Some(m) = obj["metadata"].as_object_mut() {
                m.remove(f);
            }
        }
        set_meta(&mut obj, "generation", json!(1));
        let stored = self.obj_put(res, obj);
        ok_json(StatusCode::CREATED, &stored)
    }

    /// PUT, and every PATCH once applied: `new` is the whole object the client wants.
    /// Keeps what the server owns, the status (main resource) or all but it (`/status`).
    fn obj_write(&mut self, t: &Target, current: Value, mut new: Value) -> Response {
        let res = t.res;
        let name = t.name.clone().unwrap_or_default();
        if let Some(rv) = meta(&new, "resourceVersion")
            && !rv.is_empty()
            && Some(&rv) != meta(&current, "resourceVersion").as_ref()
        {
            return conflict(res, &name);
        }
        if meta(&new, "name").as_deref() != Some(name.as_str()) {
            return error(
                400,
                "BadRequest",
                format!(
                    "the name of the object ({:?}) does not match the name on the URL ({name})",
                    meta(&new, "name")
                ),
            );
        }
        if t.status {
            let mut whole = current.clone();
            whole["status"] = new.get("status").cloned().unwrap_or(Value::Null);
            if whole["status"].is_null()
                && let Some(m) = whole.as_object_mut()
            {
                m.remove("status");
            }
            new = whole;
        } else if res.status {
            match current.get("status") {
                Some(s) => new["status"] = s.clone(),
                None => {
                    if let Some(m) = new.as_object_mut() {
                        m.remove("status");
                    }
                }
            }
        }
        new["apiVersion"] = res.api.into();
        new["kind"] = res.kind.into();
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "namespace",
            "generation",
            "resourceVersion",
        ] {
            match current["metadata"].get(f) {
                Some(v) => set_meta(&mut new, f, v.clone()),
                None => {
                    if let Some(m) = new["metadata"].as_object_mut() {
                        m.remove(f);
                    }
                }
            }
        }
        if spec_part(&new) != spec_part(&current) {
            let g = current
                .pointer("/metadata/generation")
                .and_then(Value::as_i64)
                .unwrap_or(1);
            set_meta(&mut new, "generation", json!(g + 1));
        }
        if new == current {
            // A no-op write stores nothing and tells no watch.
            return ok_json(StatusCode::OK, &current);
        }
        match self.obj_commit(res, Some(current.clone()), Some(new)) {
            Some(stored) => ok_json(StatusCode::OK, &stored),
            // Its last finalizer went: the API server answers with the object as it was last.
            None => ok_json(StatusCode::OK, &current),
        }
    }

    /// PUT: an update.
    pub(super) fn obj_update(&mut self, t: &Target, body: &[u8]) -> Response {
        let name = t.name.clone().unwrap_or_default();
        let new: Value = match serde_json::from_slice(body) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => return error(400, "BadRequest", "the body is not a JSON object"),
            Err(e) => return error(400, "BadRequest", format!("decoding the body: {e}")),
        };
        let ns = t.ns.clone().unwrap_or_default();
        let Some(current) = self.objects.get(t.res, &ns, &name).cloned() else {
            return not_found(t.res, &name);
        };
        self.obj_write(t, current, new)
    }

    /// PATCH: JSON merge, strategic merge (as JSON merge), JSON patch, or server-side apply (a
    /// merge of the fields given; creates a missing object).
    pub(super) fn obj_patch(
        &mut self,
        t: &Target,
        content_type: &str,
        q: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Response {
        let name = t.name.clone().unwrap_or_default();
        let ns = t.ns.clone().unwrap_or_default();
        let kind = content_type.split(';').next().unwrap_or("").trim();
        let apply = kind == "application/apply-patch+yaml";
        if apply && q.get("fieldManager").is_none_or(|m| m.is_empty()) {
            return error(
                400,
                "BadRequest",
                "fieldManager is required for apply requests",
            );
        }
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => {
                return error(
                    400,
                    "BadRequest",
                    format!(
                        "decoding the patch: {e} (this test server reads patches, apply patches too, as JSON)"
                    ),
                );
            }
        };
        let current = self.objects.get(t.res, &ns, &name).cloned();
        let Some(current) = current else {
            if apply && !t.status {
                let mut obj = patch;
                set_meta(&mut obj, "name", name.into());
                let body = serde_json::to_vec(&obj).expect("JSON serialises");
                return self.obj_create(t, &body);
            }
            return not_found(t.res, &name);
        };
        let mut new = current.clone();
        match kind {
            "application/merge-patch+json"
            | "application/strategic-merge-patch+json"
            | "application/apply-patch+yaml" => {
                if let Some(rv) = patch
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    && Some(rv) != meta(&current, "resourceVersion").as_deref()
                {
                    return conflict(t.res, &name);
                }
                json_patch::merge(&mut new, &patch);
            }
            "application/json-patch+json" => {
                let ops: json_patch::Patch = match serde_json::from_value(patch) {
                    Ok(p) => p,
                    Err(e) => {
                        return error(400, "BadRequest", format!("decoding the JSON patch: {e}"));
                    }
                };
                if let Err(e) = json_patch::patch(&mut new, &ops) {
                    return error(
                        422,
                        "Invalid",
                        format!(
                            "the JSON patch does not apply to {} \"{name}\": {e}",
                            qualified(t.res)
                        ),
                    );
                }
            }
            other => {
                return error(
                    415,
                    "UnsupportedMediaType",
                    format!(
                        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {other:?})"
                    ),
                );
            }
        }
        // The patch's resourceVersion was a precondition, checked above; not one to keep.
        set_meta(
            &mut new,
            "resourceVersion",
            current["metadata"]["resourceVersion"].clone(),
        );
        self.obj_write(t, current, new)
    }

    /// DELETE of one object, with DeleteOptions' preconditions and propagation policy.
    pub(super) fn obj_delete_req(&mut self, t: &Target, body: &[u8]) -> Response {
        let opts: Value = if body.is_empty() {
            Value::Null
        } else {
            match serde_json::from_slice(body) {
                Ok(v) => v,
                Err(e) => return error(400, "BadRequest", format!("decoding DeleteOptions: {e}")),
            }
        };
        let ns = t.ns.clone().unwrap_or_default();
        let Some(name) = t.name.clone() else {
            return error(405, "MethodNotAllowed", "a delete names an object");
        };
        let Some(current) = self.objects.get(t.res, &ns, &name).cloned() else {
            return not_found(t.res, &name);
        };
        let pre = &opts["preconditions"];
        if let Some(want) = pre["uid"].as_str()
            && meta(&current, "uid").as_deref() != Some(want)
        {
            let msg = format!(
                "Precondition failed: UID in precondition: {want}, UID in object meta: {}",
                meta(&current, "uid").unwrap_or_default()
            );
            return error(409, "Conflict", msg);
        }
        if let Some(want) = pre["resourceVersion"].as_str()
            && meta(&current, "resourceVersion").as_deref() != Some(want)
        {
            return conflict(t.res, &name);
        }
        let orphan = opts["propagationPolicy"].as_str() == Some("Orphan");
        let out = if orphan && !finalizers_left(&current) {
            self.obj_remove(t.res, current.clone(), false)
        } else {
            self.obj_delete(t.res, current.clone())
        };
        ok_json(StatusCode::OK, &out.unwrap_or(current))
    }

    /// DELETE of a collection: each object the selectors match, as a delete of it.
    pub(super) fn obj_delete_collection(
        &mut self,
        t: &Target,
        q: &BTreeMap<String, String>,
    ) -> Response {
        let sel = match ObjSelector::parse(q) {
            Ok(s) => s,
            Err(e) => return error(400, "BadRequest", e),
        };
        let mut items = Vec::new();
        for o in self.objects.all(t.res) {
            let in_ns =
                t.ns.as_ref()
                    .is_none_or(|n| meta(&o, "namespace").as_deref() == Some(n.as_str()));
            if in_ns && sel.matches(&o) {
                items.extend(self.obj_delete(t.res, o));
            }
        }
        ok_json(
            StatusCode::OK,
            &json!({"apiVersion": t.res.api, "kind": format!("{}List", t.res.kind),
                    "metadata": {"resourceVersion": self.rv.to_string()}, "items": items}),
        )
    }
}
