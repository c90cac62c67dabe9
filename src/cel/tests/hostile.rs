//! Evaluation errors, explanations, hostile expressions and budgets.

use super::*;

#[test]
fn errors_are_evaluation_errors_not_false() {
    let env = Environment::new();
    let d = profile_devices("dgx-h100").remove(0);
    let dv = env.device("gpu.nvidia.com", &d).unwrap();
    let cases: &[(&str, &str)] = &[
        // A missing attribute, as in Kubernetes.
        (
            "device.attributes['gpu.nvidia.com'].noSuch == 1",
            "no such key: noSuch",
        ),
        // Type mismatch: a string compared with an int.
        ("device.attributes['gpu.nvidia.com'].productName > 3", ""),
        // A bad quantity.
        (
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('lots'))",
            "quantity",
        ),
        ("semver('not.a.version').major() == 1", "semver"),
        // Not a bool.
        (
            "device.attributes['gpu.nvidia.com'].index + 1",
            "could not be converted to bool",
        ),
    ];
    for (expr, text) in cases {
        let sel = Selector::compile(expr).unwrap();
        match sel.evaluate(&env, &dv) {
            Err(e) => assert!(e.to_string().contains(text), "{expr}: {e}"),
            Ok(v) => panic!("{expr}: evaluated to {v}, wanted an error"),
        }
    }
    // has() guards the missing attribute.
    let sel = Selector::compile("has(device.attributes['gpu.nvidia.com'].noSuch)").unwrap();
    assert!(!sel.evaluate(&env, &dv).unwrap());
}

#[test]
fn explanations_name_the_failing_value() {
    let env = Environment::new();
    let l40s = profile_devices("l40s-pcie").remove(0);
    let dv = env.device("gpu.nvidia.com", &l40s).unwrap();
    let cases: &[(&str, &str)] = &[
        (
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0",
            "memory 48Gi < 80Gi",
        ),
        (
            "device.attributes['gpu.nvidia.com'].type == 'gpu' && device.attributes['gpu.nvidia.com'].type == 'mig'",
            "type \"gpu\" != \"mig\"",
        ),
        (
            "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('64Gi'))",
            "memory 48Gi <= 64Gi",
        ),
        (
            "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('500.0.0'))",
            "driverVersion",
        ),
        (
            "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('h100')",
            "productName \"nvidia l40s\" does not match \"h100\"",
        ),
        (
            "device.attributes['gpu.nvidia.com'].noSuch",
            "error: no such key: noSuch",
        ),
    ];
    for (expr, want) in cases {
        let sel = Selector::compile(expr).unwrap();
        let why = sel.explain(&env, &dv).expect("fails");
        assert!(why.contains(want), "{expr}: {why:?} lacks {want:?}");
    }
    let ok = Selector::compile("device.attributes['gpu.nvidia.com'].type == 'gpu'").unwrap();
    assert_eq!(ok.explain(&env, &dv), None);
}

#[test]
fn hostile_expressions_are_refused_cleanly() {
    let long = format!("'{}' == ''", "a".repeat(MAX_EXPRESSION_LENGTH));
    assert!(matches!(
        Selector::compile(&long),
        Err(CompileError::TooLong { .. })
    ));
    for deep in [
        format!("{}true{}", "(".repeat(5000), ")".repeat(5000)),
        format!("{}1]", "[".repeat(5000)),
        format!("{}true", "!".repeat(5000)),
        format!("{}1 == 1", "-".repeat(5000)),
    ] {
        assert!(
            matches!(Selector::compile(&deep), Err(CompileError::TooDeep { .. })),
            "{}",
            &deep[..20]
        );
    }
    // Nesting the text check accepts but the parser does not.
    let nested_calls = format!("{}true{}", "(".repeat(MAX_NESTING), ")".repeat(MAX_NESTING));
    let _ = Selector::compile(&nested_calls);
    // Long operator chains: the parser's recursion limit or ours, never a crash.
    for chain in [
        vec!["1"; 3000].join(" + ") + " > 0",
        vec!["true"; 3000].join(" && "),
        format!("device{}", ".a".repeat(3000)),
    ] {
        if let Ok(sel) = Selector::compile(&chain) {
            let env = Environment::new();
            let dv = env.device("x", &device(&[], &[], None)).unwrap();
            let _ = sel.evaluate(&env, &dv);
        }
    }
    // Parens inside strings are not nesting.
    let in_string = format!("'{}' != ''", "(".repeat(100));
    assert!(Selector::compile(&in_string).is_ok());
    // Message construction would panic the interpreter: refused at compile time.
    assert!(Selector::compile("Foo{a: 1} == 1").is_err());
}

fn doubling(n: usize) -> String {
    let mut e = format!("s{}.size() > 0", n - 1);
    for i in (0..n).rev() {
        let init = if i == 0 {
            "'abcdefgh'".to_string()
        } else {
            format!("s{} + s{}", i - 1, i - 1)
        };
        e = format!("cel.bind(s{i}, {init}, {e})");
    }
    e
}

#[test]
fn budgets_stop_runaway_evaluations() {
    let env = Environment::new();
    let dv = env.device("x", &device(&[], &[], None)).unwrap();
    let cases = [
        // 8M iterations.
        "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(a, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(b, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(c, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(d, [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20].all(e, true)))))",
        // Doubling a string through bindings: 2^28 bytes without the cap.
        &doubling(25),
    ];
    for expr in cases {
        let sel = Selector::compile(expr).unwrap();
        let r = sel.evaluate(&env, &dv);
        assert!(
            matches!(
                r,
                Err(EvalError::CostLimit { .. } | EvalError::TooLarge { .. })
            ),
            "{expr}: {r:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random text: compiles or is refused; evaluating what compiles never panics or hangs.
    #[test]
    fn random_expressions_never_panic(expr in "[a-z0-9 .()\\[\\]{}'\"!&|<>=+*/%?:,_-]{0,200}") {
        let env = Environment::new();
        let dv = env.device("x", &device(&[("a", int(1))], &[("m", "1Gi")], None)).unwrap();
        if let Ok(sel) = Selector::compile(&expr) {
            let _ = sel.evaluate(&env, &dv);
            let _ = sel.explain(&env, &dv);
        }
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Structured hostile expressions: deep nesting, long strings, huge comprehensions.
    #[test]
    fn hostile_shapes_never_panic_or_hang(
        depth in 0usize..200,
        width in 1usize..60,
        nest in 1usize..8,
        len in 0usize..20000,
        pick in 0usize..5,
    ) {
        let list = format!("[{}]", (0..width).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        let expr = match pick {
            0 => format!("{}true{}", "(".repeat(depth), ")".repeat(depth)),
            1 => format!("'{}'.size() > 0", "x".repeat(len)),
            2 => {
                let mut e = "true".to_string();
                for i in 0..nest {
                    e = format!("{list}.all(v{i}, {e})");
                }
                e
            }
            3 => {
                let mut e = "true".to_string();
                for i in 0..nest {
                    e = format!("{list}.map(v{i}, {list}).size() > 0 && {e}");
                }
                e
            }
            _ => format!("{}device.driver{} == 'x'", "cel.bind(a, 1, ".repeat(depth % 40), ")".repeat(depth % 40)),
        };
        let env = Environment::new();
        let dv = env.device("x", &device(&[], &[], None)).unwrap();
        if let Ok(sel) = Selector::compile(&expr) {
            let _ = sel.evaluate(&env, &dv);
        }
    }
}
