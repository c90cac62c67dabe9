# A ValidatingAdmissionPolicy evaluator on an evaluator nvdra did not write: Google's CEL (cel-cpp,
# through the cel-expr-python bindings), with the optional syntax (`?.`, `[?k]`, `orValue`) and
# the strings extension (`join`) that Kubernetes' CEL environment has.
#
# stdin: {"policy": <ValidatingAdmissionPolicy>, "requests": [{"request": ..., "object": ...,
# "oldObject": ...}, ...]}. stdout: one answer per request, as the API server decides with
# failurePolicy Fail: {"matched": false} when the policy does not apply (matchConstraints,
# matchConditions), else {"matched": true, "allowed": bool, "failed": index of the first
# validation that is false or null, "message": its message, "error": the evaluation error, if
# that is why}. Every expression is compiled with the type checker on, variables typed dyn
# (Kubernetes types `object` by the resource's schema: stricter than here, never looser on
# what these tests use).
import json
import sys

from cel_expr_python import cel
from cel_expr_python.ext import ext_optional, ext_strings

ENV = cel.NewEnv(
    variables={
        name: cel.Type.DYN
        for name in ("request", "object", "oldObject", "params", "namespaceObject", "variables")
    },
    extensions=[ext_optional.ExtOptional(), ext_strings.ExtStrings()],
)


def compiled(expression, cache={}):
    if expression not in cache:
        cache[expression] = ENV.compile(expression)
    return cache[expression]


def evaluate(expression, data):
    return compiled(expression).eval(data=data).plain_value()


def rule_matches(rules, request):
    resource = request["resource"]["resource"]
    if request.get("subResource"):
        resource += "/" + request["subResource"]
    for rule in rules:
        if request["resource"]["group"] not in rule["apiGroups"] and "*" not in rule["apiGroups"]:
            continue
        if request["operation"] not in rule["operations"] and "*" not in rule["operations"]:
            continue
        if resource in rule["resources"] or "*" in rule["resources"]:
            return True
    return False


def decide(policy, sample):
    spec = policy["spec"]
    request = sample["request"]
    if not rule_matches(spec["matchConstraints"]["resourceRules"], request):
        return {"matched": False}
    data = {
        "request": request,
        "object": sample.get("object"),
        "oldObject": sample.get("oldObject"),
        "params": None,
        "namespaceObject": None,
        "variables": {},
    }
    for condition in spec.get("matchConditions", []):
        if evaluate(condition["expression"], data) is not True:
            return {"matched": False}
    variables = {}
    for variable in spec.get("variables", []):
        data["variables"] = dict(variables)
        try:
            variables[variable["name"]] = evaluate(variable["expression"], data)
        except Exception as e:
            # Kubernetes evaluates variables lazily: one that errs fails the validations that
            # use it. Eagerly here, so any error denies: stricter, and named in the answer.
            error = f"variable {variable['name']}: {e}"
            return {"matched": True, "allowed": False, "failed": None, "error": error, "message": None}
    data["variables"] = variables
    for i, validation in enumerate(spec["validations"]):
        try:
            result = evaluate(validation["expression"], data)
        except Exception as e:
            return {"matched": True, "allowed": False, "failed": i, "error": str(e), "message": None}
        if result is True:
            continue
        message = validation.get("message")
        if "messageExpression" in validation:
            message = evaluate(validation["messageExpression"], data)
        return {"matched": True, "allowed": False, "failed": i, "message": message}
    return {"matched": True, "allowed": True}


def main():
    given = json.load(sys.stdin)
    policy = given["policy"]
    # Every expression compiles, whether or not a sample reaches it.
    spec = policy["spec"]
    for expression in (
        [c["expression"] for c in spec.get("matchConditions", [])]
        + [v["expression"] for v in spec.get("variables", [])]
        + [v["expression"] for v in spec["validations"]]
        + [v["messageExpression"] for v in spec["validations"] if "messageExpression" in v]
    ):
        compiled(expression)
    json.dump([decide(policy, s) for s in given["requests"]], sys.stdout)


main()
