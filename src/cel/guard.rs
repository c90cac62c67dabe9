//! What stands between a user's expression and the interpreter: a size and nesting check on the
//! text (before the parser sees it, because a deep enough expression overflows the parser's
//! stack), and a rewrite of the parsed tree that adds what the interpreter lacks — `cel.bind`,
//! Kubernetes' empty map for an unknown attribute domain, and a cost meter on every call.
//!
//! The meter: every call, identifier, field selection and list or map literal is wrapped in a
//! call to [`COST`], which charges one unit plus the size of the value (bytes of a string,
//! elements of a list or map) against a per-evaluation budget, and refuses values larger than
//! [`MAX_VALUE_SIZE`]. A comprehension's accumulator is charged one unit per step instead of its
//! size (the interpreter appends to it in place), so `list.map(x, …)` costs its length, not its
//! length squared. Work per charged unit is bounded, so a budget bounds time, and the size cap
//! bounds memory; together they replace the runtime cost limit cel-go has and `cel` lacks.

use kube_cel::cel::common::ast::{
    CallExpr, ComprehensionExpr, EntryExpr, Expr, IdedExpr, ListExpr, operators,
};

/// The metering function's name; `@` keeps it out of what users can write.
pub(super) const COST: &str = "@nvdra.cost";
/// Charges [`REGEX_COST`] units plus the value's size: the regex functions compile their pattern
/// on every call.
pub(super) const COST_REGEX: &str = "@nvdra.cost_regex";
/// What one regex call costs: compiling a pattern takes about as long as this many other steps.
pub const REGEX_COST: u64 = 256;
/// Charges one unit without the value's size (a comprehension's accumulator).
pub(super) const TICK: &str = "@nvdra.tick";
/// `device.attributes[domain]` / `device.capacity[domain]`: the domain's map, or an empty one.
pub(super) const DOMAIN: &str = "@nvdra.domain";

/// Largest string (bytes), list or map (elements) an evaluation may build.
pub const MAX_VALUE_SIZE: usize = 1 << 20;

/// Why the text or the tree is refused before evaluation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Refusal {
    /// Brackets or unary operators nested deeper than the bound, at this byte offset.
    TooDeep { offset: usize, max: usize },
    /// Message construction (`Type{field: …}`): the DRA environment declares no message types.
    Struct { type_name: String },
    /// `cel.bind` with the wrong shape.
    BadBind,
    /// The tree is deeper than the evaluator may recurse.
    TreeTooDeep { max: usize },
}

/// Checks bracket and unary-operator nesting in `text`, skipping string literals, without
/// recursion: the parser recurses per nesting level and would overflow its stack on hostile input
/// before its own limit applies.
pub(super) fn check_nesting(text: &str, max: usize) -> Result<(), Refusal> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut unary_run = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'\'' | b'"' => {
                // Triple-quoted strings end at the same triple; others at the same quote.
                let triple = bytes.len() >= i + 3 && bytes[i + 1] == c && bytes[i + 2] == c;
                let raw = i > 0 && matches!(bytes[i - 1], b'r' | b'R');
                i += if triple { 3 } else { 1 };
                while i < bytes.len() {
                    if bytes[i] == b'\\' && !raw {
                        i += 2;
                        continue;
                    }
                    if triple {
                        if bytes.len() >= i + 3 && bytes[i..i + 3] == [c, c, c] {
                            i += 3;
                            break;
                        }
                    } else if bytes[i] == c {
                        i += 1;
                        break;
                    }
                    i += 1;
                }
                unary_run = 0;
                continue;
            }
            b'(' | b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return Err(Refusal::TooDeep { offset: i, max });
                }
            }
            b')' | b']' | b'}' => depth = depth.saturating_sub(1),
            b'!' | b'-' => {
                // `!=` is an operator, not a negation.
                if c == b'!' && bytes.get(i + 1) == Some(&b'=') {
                    unary_run = 0;
                    i += 2;
                    continue;
                }
                unary_run += 1;
                if unary_run > max {
                    return Err(Refusal::TooDeep { offset: i, max });
                }
            }
            b' ' | b'\t' | b'\n' | b'\r' => {}
            _ => unary_run = 0,
        }
        i += 1;
    }
    Ok(())
}

/// Rewrites a parsed tree for evaluation; `depth` bounds the recursion of this and of the
/// interpreter.
pub(super) fn rewrite(e: IdedExpr, max_depth: usize) -> Result<IdedExpr, Refusal> {
    let mut next_id = u64::MAX / 2;
    let mut r = Rewriter {
        next_id: &mut next_id,
        max_depth,
    };
    r.expr(e, 0, &[])
}

struct Rewriter<'a> {
    next_id: &'a mut u64,
    max_depth: usize,
}

impl Rewriter<'_> {
    fn id(&mut self) -> u64 {
        *self.next_id += 1;
        *self.next_id
    }

    fn call(&mut self, func: &str, args: Vec<IdedExpr>) -> IdedExpr {
        IdedExpr {
            id: self.id(),
            expr: Expr::Call(CallExpr {
                func_name: func.to_string(),
                target: None,
                args,
            }),
        }
    }

    fn meter(&mut self, e: IdedExpr) -> IdedExpr {
        self.call(COST, vec![e])
    }

    /// `accus`: the comprehension accumulators in scope (charged per step, not per size).
    fn expr(&mut self, e: IdedExpr, depth: usize, accus: &[String]) -> Result<IdedExpr, Refusal> {
        if depth > self.max_depth {
            return Err(Refusal::TreeTooDeep {
                max: self.max_depth,
            });
        }
        let d = depth + 1;
        let IdedExpr { id, expr } = e;
        Ok(match expr {
            Expr::Literal(_) => IdedExpr { id, expr },
            Expr::Ident(ref name) => {
                if accus.iter().any(|a| a == name) {
                    IdedExpr { id, expr }
                } else {
                    self.meter(IdedExpr { id, expr })
                }
            }
            Expr::Unspecified => IdedExpr { id, expr },
            Expr::Struct(s) => {
                return Err(Refusal::Struct {
                    type_name: s.type_name,
                });
            }
            Expr::Select(mut s) => {
                // `device.attributes.foo` reads domain `foo`: an empty map when unknown.
                if !s.test && is_domain_map(&s.operand) {
                    let operand = self.expr(*s.operand, d, accus)?;
                    let key = IdedExpr {
                        id: self.id(),
                        expr: Expr::Literal(kube_cel::cel::common::ast::LiteralValue::String(
                            s.field.clone().into(),
                        )),
                    };
                    let c = self.call(DOMAIN, vec![operand, key]);
                    return Ok(self.meter(c));
                }
                let operand = self.expr(*s.operand, d, accus)?;
                s.operand = Box::new(operand);
                self.meter(IdedExpr {
                    id,
                    expr: Expr::Select(s),
                })
            }
            Expr::List(l) => {
                let ListExpr {
                    elements,
                    optional_indices,
                } = l;
                let elements = elements
                    .into_iter()
                    .map(|x| self.expr(x, d, accus))
                    .collect::<Result<_, _>>()?;
                self.meter(IdedExpr {
                    id,
                    expr: Expr::List(ListExpr {
                        elements,
                        optional_indices,
                    }),
                })
            }
            Expr::Map(mut m) => {
                for entry in &mut m.entries {
                    match &mut entry.expr {
                        EntryExpr::MapEntry(me) => {
                            me.key = self.expr(std::mem::take(&mut me.key), d, accus)?;
                            me.value = self.expr(std::mem::take(&mut me.value), d, accus)?;
                        }
                        EntryExpr::StructField(_) => return Err(Refusal::BadBind),
                    }
                }
                self.meter(IdedExpr {
                    id,
                    expr: Expr::Map(m),
                })
            }
            Expr::Comprehension(c) => {
                let ComprehensionExpr {
                    iter_range,
                    iter_var,
                    iter_var2,
                    accu_var,
                    accu_init,
                    loop_cond,
                    loop_step,
                    result,
                } = *c;
                let iter_range = self.expr(iter_range, d, accus)?;
                let accu_init = self.expr(accu_init, d, accus)?;
                let mut inner: Vec<String> = accus.to_vec();
                inner.push(accu_var.clone());
                let loop_cond = self.expr(loop_cond, d, &inner)?;
                let step = self.expr(loop_step, d, &inner)?;
                let loop_step = self.call(TICK, vec![step]);
                // The result sees the accumulator as a value (a `cel.bind` variable).
                let result = self.expr(result, d, &inner)?;
                IdedExpr {
                    id,
                    expr: Expr::Comprehension(Box::new(ComprehensionExpr {
                        iter_range,
                        iter_var,
                        iter_var2,
                        accu_var,
                        accu_init,
                        loop_cond,
                        loop_step,
                        result,
                    })),
                }
            }
            Expr::Call(c) => {
                let CallExpr {
                    func_name,
                    target,
                    args,
                } = c;
                // cel.bind(name, init, body): a comprehension over nothing whose accumulator is
                // the bound name, as cel-go expands it.
                if func_name == "bind"
                    && matches!(target.as_deref(), Some(IdedExpr { expr: Expr::Ident(t), .. }) if t == "cel")
                {
                    let [name, init, body]: [IdedExpr; 3] =
                        args.try_into().map_err(|_| Refusal::BadBind)?;
                    let Expr::Ident(var) = name.expr else {
                        return Err(Refusal::BadBind);
                    };
                    let init = self.expr(init, d, accus)?;
                    let body = self.expr(body, d, accus)?;
                    let empty = IdedExpr {
                        id: self.id(),
                        expr: Expr::List(ListExpr::default()),
                    };
                    let never = IdedExpr {
                        id: self.id(),
                        expr: Expr::Literal(kube_cel::cel::common::ast::LiteralValue::Boolean(
                            false.into(),
                        )),
                    };
                    let step = IdedExpr {
                        id: self.id(),
                        expr: Expr::Ident(var.clone()),
                    };
                    return Ok(IdedExpr {
                        id,
                        expr: Expr::Comprehension(Box::new(ComprehensionExpr {
                            iter_range: empty,
                            iter_var: "#unused".into(),
                            iter_var2: None,
                            accu_var: var,
                            accu_init: init,
                            loop_cond: never,
                            loop_step: step,
                            result: body,
                        })),
                    });
                }
                // device.attributes["domain"]: an empty map when the domain is unknown.
                if func_name == operators::INDEX && args.len() == 2 && is_domain_map(&args[0]) {
                    let mut it = args.into_iter();
                    let (Some(m), Some(k)) = (it.next(), it.next()) else {
                        return Err(Refusal::BadBind);
                    };
                    let m = self.expr(m, d, accus)?;
                    let k = self.expr(k, d, accus)?;
                    let c = self.call(DOMAIN, vec![m, k]);
                    return Ok(self.meter(c));
                }
                let touches_accu = args
                    .iter()
                    .any(|a| matches!(&a.expr, Expr::Ident(n) if accus.contains(n)));
                // A qualified function (`sets.contains`) is looked up by its target's name:
                // that identifier stays as written.
                let target = match target {
                    Some(t) if matches!(t.expr, Expr::Ident(_)) => Some(t),
                    Some(t) => Some(Box::new(self.expr(*t, d, accus)?)),
                    None => None,
                };
                let args = args
                    .into_iter()
                    .map(|a| self.expr(a, d, accus))
                    .collect::<Result<_, _>>()?;
                let call = IdedExpr {
                    id,
                    expr: Expr::Call(CallExpr {
                        func_name,
                        target,
                        args,
                    }),
                };
                let regex = matches!(&call.expr, Expr::Call(c) if matches!(c.func_name.as_str(), "matches" | "find" | "findAll"));
                if touches_accu {
                    self.call(TICK, vec![call])
                } else if regex {
                    self.call(COST_REGEX, vec![call])
                } else {
                    self.meter(call)
                }
            }
        })
    }
}

/// `device.attributes` or `device.capacity`, as parsed.
fn is_domain_map(e: &IdedExpr) -> bool {
    match &e.expr {
        Expr::Select(s) if !s.test && (s.field == "attributes" || s.field == "capacity") => {
            matches!(&s.operand.expr, Expr::Ident(n) if n == "device")
        }
        _ => false,
    }
}

/// The expression under the meter's wrappers.
pub(super) fn unwrap(e: &IdedExpr) -> &IdedExpr {
    match &e.expr {
        Expr::Call(c)
            if (c.func_name == COST || c.func_name == TICK || c.func_name == COST_REGEX)
                && c.args.len() == 1 =>
        {
            unwrap(&c.args[0])
        }
        _ => e,
    }
}
