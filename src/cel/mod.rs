//! The Kubernetes DRA CEL environment: device selectors of DeviceClasses and ResourceClaims,
//! compiled and evaluated as the scheduler does (`k8s.io/dynamic-resource-allocation/cel`).
//!
//! The `device` variable has `driver`, `attributes[domain][name]` (int, bool, string, and a
//! version as a semver value; names without a domain live in the driver's domain),
//! `capacity[domain][name]` as quantities, and `allowMultipleAllocations`. Kubernetes' CEL
//! libraries (quantity, semver, strings, lists, sets, regex, …) come from kube-cel; `cel.bind` and
//! the macros from the rewrite in `guard`. As in Kubernetes, an unknown domain reads as an empty
//! map and an unknown attribute name is an evaluation error (guard it with `has()` or `in`).
//!
//! Invariants: no expression, however hostile, panics the process, overflows the stack or runs
//! unbounded. Text over [`MAX_EXPRESSION_LENGTH`] or nested deeper than [`MAX_NESTING`] is
//! refused before the parser sees it; the parser's own recursion limit and a bound on the tree's
//! depth follow; evaluation runs under a cost budget ([`MAX_COST`] units, see `guard`) and a value
//! size cap, and an interpreter panic, should one remain, becomes an error.

mod explain;
mod guard;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use k8s_openapi::api::resource::v1::Device;
use kube_cel::KubeCelExt;
use kube_cel::cel::common::ast::{Expr, IdedExpr, LiteralValue};
use kube_cel::cel::objects::{Key, Map};
use kube_cel::cel::parser::Parser;
use kube_cel::cel::{Context, ExecutionError, FunctionContext, ResolveResult, Value};

pub use explain::describe_value;
pub use guard::MAX_VALUE_SIZE;

/// Longest selector expression (`CELSelectorExpressionMaxLength`, bytes).
pub const MAX_EXPRESSION_LENGTH: usize = 10 * 1024;
/// Deepest bracket or unary-operator nesting accepted in the text.
pub const MAX_NESTING: usize = 32;
/// The parser's recursion limit.
const PARSER_RECURSION: u16 = 64;
/// Deepest parsed tree the evaluator recurses into.
const MAX_TREE_DEPTH: usize = 1000;
/// Cost units one evaluation may spend (`CELSelectorExpressionMaxCost`; units differ from
/// cel-go's, the order of magnitude is the same).
pub const MAX_COST: u64 = 1_000_000;

/// Why an expression does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    #[error("expression is {len} bytes long, more than the {max} allowed")]
    TooLong { len: usize, max: usize },
    #[error("expression nests deeper than {max} levels at column {column}")]
    TooDeep { column: usize, max: usize },
    #[error("syntax error at line {line}, column {column}: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    #[error("{message}")]
    Unsupported { message: String },
    #[error("must evaluate to bool or the unknown type, not {found}")]
    NotBool { found: &'static str },
}

impl CompileError {
    /// 1-based column of the problem, where known.
    pub fn column(&self) -> Option<usize> {
        match self {
            CompileError::TooDeep { column, .. } | CompileError::Syntax { column, .. } => {
                Some(*column)
            }
            _ => None,
        }
    }
}

/// Why an expression could not be evaluated for a device.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EvalError {
    #[error("no such key: {0}")]
    NoSuchKey(String),
    #[error("actual cost limit exceeded: more than {max} cost units")]
    CostLimit { max: u64 },
    #[error("a value grew past {max} bytes or elements")]
    TooLarge { max: usize },
    #[error("CEL result of type {found} could not be converted to bool")]
    NotBool { found: String },
    #[error("{0}")]
    Cel(String),
    #[error("the CEL interpreter failed on this expression: {0}")]
    Internal(String),
}

/// A device attribute or capacity that cannot become a CEL value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    #[error("device {device}: capacity {name} has an invalid quantity {value:?}")]
    BadQuantity {
        device: String,
        name: String,
        value: String,
    },
    #[error("device {device}: attribute {name} has an invalid version {value:?}")]
    BadVersion {
        device: String,
        name: String,
        value: String,
    },
    #[error("device {device}: attribute {name} has no value")]
    EmptyAttribute { device: String, name: String },
}

/// The functions and libraries every evaluation sees; build once, share for many evaluations.
pub struct Environment {
    root: Context<'static>,
    quantity: IdedExpr,
    semver: IdedExpr,
}

impl Default for Environment {
    fn default() -> Self {
        Self::new()
    }
}

thread_local! {
    /// Units left in the running evaluation; `u64::MAX` outside one.
    static BUDGET: Cell<u64> = const { Cell::new(u64::MAX) };
    /// Why the meter stopped the running evaluation.
    static STOPPED: Cell<Option<Stop>> = const { Cell::new(None) };
}

#[derive(Debug, Clone, Copy)]
enum Stop {
    Cost,
    Size,
}

fn size_of(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Bytes(b) => b.len(),
        Value::List(l) => l.len(),
        Value::Map(m) => m.map.len(),
        _ => 0,
    }
}

fn charge(units: u64) -> Result<(), ExecutionError> {
    BUDGET.with(|b| {
        let left = b.get();
        if left < units {
            b.set(0);
            STOPPED.with(|s| s.set(Some(Stop::Cost)));
            Err(ExecutionError::function_error("cost", "budget exceeded"))
        } else {
            b.set(left - units);
            Ok(())
        }
    })
}

fn cap(v: &Value) -> Result<(), ExecutionError> {
    if size_of(v) > MAX_VALUE_SIZE {
        STOPPED.with(|s| s.set(Some(Stop::Size)));
        return Err(ExecutionError::function_error("cost", "value too large"));
    }
    Ok(())
}

/// Stack left below which the next level of the tree is evaluated on a fresh segment: a debug
/// build's interpreter takes tens of KiB per level.
const RED_ZONE: usize = 256 << 10;
/// Size of each fresh stack segment.
const STACK_SEGMENT: usize = 4 << 20;

/// Evaluates the wrapped expression on enough stack: every level of a rewritten tree passes
/// through here, so no depth the tree bound allows can overflow the thread's stack.
fn resolve_arg(ftx: &FunctionContext) -> ResolveResult {
    let e = ftx
        .args
        .first()
        .ok_or_else(|| ExecutionError::function_error("cost", "no argument"))?;
    stacker::maybe_grow(RED_ZONE, STACK_SEGMENT, || ftx.ptx.resolve(e))
}

fn meter_cost(ftx: &FunctionContext) -> ResolveResult {
    let v = resolve_arg(ftx)?;
    cap(&v)?;
    charge(1 + size_of(&v) as u64)?;
    Ok(v)
}

fn meter_regex(ftx: &FunctionContext) -> ResolveResult {
    let v = resolve_arg(ftx)?;
    cap(&v)?;
    charge(guard::REGEX_COST + size_of(&v) as u64)?;
    Ok(v)
}

fn meter_tick(ftx: &FunctionContext) -> ResolveResult {
    let v = resolve_arg(ftx)?;
    cap(&v)?;
    charge(1)?;
    Ok(v)
}

fn domain(m: Value, k: Value) -> ResolveResult {
    let Value::Map(map) = &m else {
        return Err(ExecutionError::function_error("_[_]", "not a map"));
    };
    let Value::String(name) = &k else {
        return Err(ExecutionError::function_error(
            "_[_]",
            "a domain is a string",
        ));
    };
    Ok(map
        .map
        .get(&Key::String(name.clone()))
        .cloned()
        .unwrap_or_else(|| Value::Map(Map::from(HashMap::<Key, Value>::new()))))
}

impl Environment {
    pub fn new() -> Self {
        let mut root = Context::default().with_all();
        root.add_function(guard::COST, meter_cost);
        root.add_function(guard::TICK, meter_tick);
        root.add_function(guard::COST_REGEX, meter_regex);
        root.add_function(guard::DOMAIN, domain);
        let call = |f: &str| IdedExpr {
            id: 1,
            expr: Expr::Call(kube_cel::cel::common::ast::CallExpr {
                func_name: f.to_string(),
                target: None,
                args: vec![IdedExpr {
                    id: 2,
                    expr: Expr::Ident("s".into()),
                }],
            }),
        };
        Environment {
            root,
            quantity: call("quantity"),
            semver: call("semver"),
        }
    }

    fn convert(&self, f: &IdedExpr, s: &str) -> Option<Value> {
        let mut ctx = self.root.new_inner_scope();
        ctx.add_variable_from_value("s", Value::String(Arc::new(s.to_string())));
        Value::resolve(f, &ctx).ok()
    }

    /// A quantity value (`quantity(s)`), or `None` when `s` is not one.
    pub fn quantity(&self, s: &str) -> Option<Value> {
        self.convert(&self.quantity, s)
    }

    /// A semver value (`semver(s)`), or `None` when `s` is not one.
    pub fn semver(&self, s: &str) -> Option<Value> {
        self.convert(&self.semver, s)
    }

    /// The `device` variable for a device of `driver`, converted once and reused for every
    /// selector.
    pub fn device(&self, driver: &str, d: &Device) -> Result<DeviceValue, DeviceError> {
        let mut attributes: BTreeMap<String, HashMap<Key, Value>> = BTreeMap::new();
        let split = |name: &str| -> (String, String) {
            match name.split_once('/') {
                Some((domain, id)) => (domain.to_string(), id.to_string()),
                None => (driver.to_string(), name.to_string()),
            }
        };
        for (name, a) in d.attributes.iter().flatten() {
            let value = if let Some(i) = a.int {
                Value::Int(i)
            } else if let Some(b) = a.bool {
                Value::Bool(b)
            } else if let Some(s) = &a.string {
                Value::String(Arc::new(s.clone()))
            } else if let Some(v) = &a.version {
                self.semver(v).ok_or_else(|| DeviceError::BadVersion {
                    device: d.name.clone(),
                    name: name.clone(),
                    value: v.clone(),
                })?
            } else {
                return Err(DeviceError::EmptyAttribute {
                    device: d.name.clone(),
                    name: name.clone(),
                });
            };
            let (domain, id) = split(name);
            attributes
                .entry(domain)
                .or_default()
                .insert(Key::String(Arc::new(id)), value);
        }
        let mut capacity: BTreeMap<String, HashMap<Key, Value>> = BTreeMap::new();
        for (name, c) in d.capacity.iter().flatten() {
            let value = self
                .quantity(&c.value.0)
                .ok_or_else(|| DeviceError::BadQuantity {
                    device: d.name.clone(),
                    name: name.clone(),
                    value: c.value.0.clone(),
                })?;
            let (domain, id) = split(name);
            capacity
                .entry(domain)
                .or_default()
                .insert(Key::String(Arc::new(id)), value);
        }
        let nested = |m: BTreeMap<String, HashMap<Key, Value>>| {
            let outer: HashMap<Key, Value> = m
                .into_iter()
                .map(|(k, v)| (Key::String(Arc::new(k)), Value::Map(Map::from(v))))
                .collect();
            Value::Map(Map::from(outer))
        };
        let mut device: HashMap<Key, Value> = HashMap::new();
        device.insert(
            Key::String(Arc::new("driver".into())),
            Value::String(Arc::new(driver.to_string())),
        );
        device.insert(
            Key::String(Arc::new("attributes".into())),
            nested(attributes),
        );
        device.insert(Key::String(Arc::new("capacity".into())), nested(capacity));
        device.insert(
            Key::String(Arc::new("allowMultipleAllocations".into())),
            Value::Bool(d.allow_multiple_allocations.unwrap_or(false)),
        );
        Ok(DeviceValue {
            driver: driver.to_string(),
            value: Value::Map(Map::from(device)),
        })
    }
}

/// The `device` variable of one device.
#[derive(Debug, Clone)]
pub struct DeviceValue {
    driver: String,
    value: Value,
}

impl DeviceValue {
    /// The driver whose domain holds unqualified names.
    pub fn driver(&self) -> &str {
        &self.driver
    }
}

/// A compiled selector expression.
#[derive(Debug, Clone)]
pub struct Selector {
    source: String,
    program: IdedExpr,
}

impl Selector {
    /// Compiles `expression`, refusing what the DRA environment refuses.
    pub fn compile(expression: &str) -> Result<Self, CompileError> {
        if expression.len() > MAX_EXPRESSION_LENGTH {
            return Err(CompileError::TooLong {
                len: expression.len(),
                max: MAX_EXPRESSION_LENGTH,
            });
        }
        guard::check_nesting(expression, MAX_NESTING).map_err(|r| match r {
            guard::Refusal::TooDeep { offset, max } => CompileError::TooDeep {
                column: column_of(expression, offset),
                max,
            },
            other => unsupported(other),
        })?;
        let program = parse(expression)?;
        Ok(Selector {
            source: expression.to_string(),
            program,
        })
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether `device` matches.
    pub fn evaluate(&self, env: &Environment, device: &DeviceValue) -> Result<bool, EvalError> {
        match self.value_of(env, device, &self.program)? {
            Value::Bool(b) => Ok(b),
            other => Err(EvalError::NotBool {
                found: type_name(&other).to_string(),
            }),
        }
    }

    /// Evaluates `expr` (this selector's tree or a part of it) for `device`, under a fresh
    /// budget.
    fn value_of(
        &self,
        env: &Environment,
        device: &DeviceValue,
        expr: &IdedExpr,
    ) -> Result<Value, EvalError> {
        let mut ctx = env.root.new_inner_scope();
        ctx.add_variable_from_value("device", device.value.clone());
        BUDGET.with(|b| b.set(MAX_COST));
        STOPPED.with(|s| s.set(None));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            stacker::maybe_grow(RED_ZONE, STACK_SEGMENT, || Value::resolve(expr, &ctx))
        }));
        BUDGET.with(|b| b.set(u64::MAX));
        let stopped = STOPPED.with(|s| s.take());
        match (result, stopped) {
            (_, Some(Stop::Cost)) => Err(EvalError::CostLimit { max: MAX_COST }),
            (_, Some(Stop::Size)) => Err(EvalError::TooLarge {
                max: MAX_VALUE_SIZE,
            }),
            (Ok(Ok(v)), None) => Ok(v),
            (Ok(Err(e)), None) => Err(match e {
                ExecutionError::NoSuchKey(k) => EvalError::NoSuchKey(k.to_string()),
                e => EvalError::Cel(e.to_string()),
            }),
            (Err(panic), None) => Err(EvalError::Internal(
                panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into()),
            )),
        }
    }

    /// Why `device` does not match, in a few words naming the values that decided it (e.g.
    /// `memory 40Gi < 80Gi`); `None` when it matches.
    pub fn explain(&self, env: &Environment, device: &DeviceValue) -> Option<String> {
        explain::explain(self, env, device)
    }
}

/// The parser recurses deeply per nesting level (an ANTLR tree), more than a test thread's
/// 2 MiB stack holds at [`MAX_NESTING`]: it runs on a thread of its own with a stack sized for
/// the worst input the checks before it let through.
fn parse(expression: &str) -> Result<IdedExpr, CompileError> {
    const PARSER_STACK: usize = 256 << 20;
    let text = expression.to_string();
    let worker = std::thread::Builder::new()
        .name("cel-parse".into())
        .stack_size(PARSER_STACK)
        .spawn(move || parse_here(&text))
        .map_err(|e| CompileError::Unsupported {
            message: format!("cannot start the CEL parser: {e}"),
        })?;
    worker.join().map_err(|_| CompileError::Unsupported {
        message: "the CEL parser failed on this expression".into(),
    })?
}

/// Parse, type-check the root and rewrite for evaluation (all recursive: on the big stack).
fn parse_here(expression: &str) -> Result<IdedExpr, CompileError> {
    let parsed = Parser::new()
        .max_recursion_depth(PARSER_RECURSION)
        .parse(expression)
        .map_err(|errs| {
            let first = errs.errors.first();
            CompileError::Syntax {
                line: first
                    .map(|e| usize::try_from(e.pos.0).unwrap_or(1).max(1))
                    .unwrap_or(1),
                // The parser's columns are 1-based already.
                column: first
                    .map(|e| usize::try_from(e.pos.1).unwrap_or(1).max(1))
                    .unwrap_or(1),
                message: first
                    .map(|e| e.msg.clone())
                    .unwrap_or_else(|| "Syntax error".into()),
            }
        })?;
    if let Some(found) = literal_type(&parsed) {
        return Err(CompileError::NotBool { found });
    }
    guard::rewrite(parsed, MAX_TREE_DEPTH).map_err(unsupported)
}

fn unsupported(r: guard::Refusal) -> CompileError {
    let message = match r {
        guard::Refusal::TooDeep { max, .. } => format!("expression nests deeper than {max} levels"),
        guard::Refusal::Struct { type_name } => {
            format!("undeclared reference to message type {type_name:?}")
        }
        guard::Refusal::BadBind => {
            "cel.bind takes a variable name, a value and an expression".to_string()
        }
        guard::Refusal::TreeTooDeep { max } => {
            format!("expression nests deeper than {max} levels once parsed")
        }
    };
    CompileError::Unsupported { message }
}

/// A literal root that can never be a bool (`1`, `"x"`, `[…]`): refused at compile time as
/// Kubernetes' type checker does.
fn literal_type(e: &IdedExpr) -> Option<&'static str> {
    match &e.expr {
        Expr::Literal(LiteralValue::Int(_)) => Some("int"),
        Expr::Literal(LiteralValue::UInt(_)) => Some("uint"),
        Expr::Literal(LiteralValue::Double(_)) => Some("double"),
        Expr::Literal(LiteralValue::String(_)) => Some("string"),
        Expr::Literal(LiteralValue::Bytes(_)) => Some("bytes"),
        Expr::Literal(LiteralValue::Null) => Some("null_type"),
        Expr::List(_) => Some("list"),
        Expr::Map(_) => Some("map"),
        _ => None,
    }
}

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::List(_) => "list",
        Value::Map(_) => "map",
        Value::Function(..) => "function",
        Value::Int(_) => "int",
        Value::UInt(_) => "uint",
        Value::Float(_) => "double",
        Value::String(_) => "string",
        Value::Bytes(_) => "bytes",
        Value::Bool(_) => "bool",
        Value::Opaque(_) => "opaque",
        Value::Null => "null",
        #[allow(unreachable_patterns)]
        _ => "value",
    }
}

/// 1-based column (in characters) of byte `offset` on its line.
fn column_of(text: &str, offset: usize) -> usize {
    let before = &text[..offset.min(text.len())];
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    before[line_start..].chars().count() + 1
}

#[cfg(test)]
mod tests;
