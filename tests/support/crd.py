# A CustomResourceDefinition's validation of objects, on checkers nvdra did not write: the
# openAPIV3Schema by the `jsonschema` package (the keywords these CRDs use, type, properties,
# required, enum, minimum, items, mean the same in JSON Schema), and the x-kubernetes-validations
# rules by Google's CEL (cel-cpp, through cel-expr-python), evaluated as the API server does:
# `self` the value at the rule's place, `oldSelf` its old value on an update; a transition rule
# (one naming oldSelf) runs only when there is an old value.
#
# stdin: {"crd": <CustomResourceDefinition>, "objects": [{"object": ..., "oldObject": ...}, ...]}
# stdout: one answer per object: {"errors": ["<path>: <message>", ...]}, empty when accepted.
import json
import sys

import jsonschema
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional, ext_strings

ENV = cel.NewEnv(
    variables={"self": cel.Type.DYN, "oldSelf": cel.Type.DYN},
    extensions=[ext_optional.ExtOptional(), ext_strings.ExtStrings()],
)


def path_of(parts):
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else ("." if out else "") + p
    return out or "<root>"


def rules(schema, new, old, parts, errors):
    for rule in schema.get("x-kubernetes-validations", []):
        transition = "oldSelf" in rule["rule"]
        if transition and old is None:
            continue
        data = {"self": new}
        if transition:
            data["oldSelf"] = old
        try:
            ok = ENV.compile(rule["rule"]).eval(data=data).plain_value()
        except Exception as e:  # an evaluation error refuses, as the API server does
            errors.append(f"{path_of(parts)}: {rule['rule']}: {e}")
            continue
        if ok is not True:
            errors.append(f"{path_of(parts)}: {rule.get('message', rule['rule'])}")
    if isinstance(new, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in new:
                before = old.get(key) if isinstance(old, dict) else None
                rules(sub, new[key], before, parts + [key], errors)
    elif isinstance(new, list) and "items" in schema:
        for i, item in enumerate(new):
            rules(schema["items"], item, None, parts + [i], errors)


def check(crd, sample):
    obj, old = sample["object"], sample.get("oldObject")
    version = obj["apiVersion"].split("/")[-1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = served["schema"]["openAPIV3Schema"]
    errors = [
        f"{path_of(list(e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft7Validator(schema).iter_errors(obj)
    ]
    group = crd["spec"]["group"]
    if obj["apiVersion"] != f"{group}/{version}" or obj["kind"] != crd["spec"]["names"]["kind"]:
        errors.append(f"<root>: {obj['apiVersion']} {obj['kind']} is not this CRD's")
    if not errors:
        rules(schema, obj, old, [], errors)
    return {"errors": errors}


def main():
    data = json.load(sys.stdin)
    json.dump([check(data["crd"], s) for s in data["objects"]], sys.stdout)


main()
