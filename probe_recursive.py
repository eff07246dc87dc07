import json, jsonschema, lcgen, itertools
from lcgen.constrain import GrammarState
model = lcgen.load("smollm2-135m")
T = {"type": "object", "properties": {"c": {"$ref": "#/$defs/T"}, "v": {"type": "integer"}}}
cases = [
 {"$defs": {"T": T}, "oneOf": [{"$ref": "#/$defs/T"}, {"type": "object", "required": ["x"]}]},
 {"$defs": {"T": T}, "oneOf": [{"$ref": "#/$defs/T"}, {"type": "object", "properties": {"v": {"minimum": 5}}}]},
 {"$defs": {"L": {"type": "object", "properties": {"next": {"$ref": "#/$defs/L"}, "v": {"not": {"type": "integer"}}}, "required": ["v"]}},
  "oneOf": [{"$ref": "#/$defs/L"}, {"type": "object", "properties": {"v": {"type": "number", "maximum": 2}}}]},
 {"oneOf": [True, True]}, {"oneOf": [True, False]}, {"oneOf": [{"type": "string"}, {"type": "string"}]},
]
vals = [{}, {"x": 1}, {"c": {}}, {"c": {"c": {"v": 1}}, "x": 1}, {"c": {"v": "s"}, "x": 1}, {"c": {"v": 2.5}}, {"v": 7}, {"v": 3},
        {"v": 1.5}, {"v": 2.5}, {"v": 1.5, "next": {"v": 3}}, {"v": 1.5, "next": {"v": 2.5}}, {"v": 3.5, "next": {"v": 1}}, {"c": 1, "x": 2},
        "s", 1, {"v": 1.5, "next": {"v": 1.5, "next": {"v": 3}}}]
for s in cases:
    try:
        g = lcgen.Grammar.from_json_schema(s)
    except lcgen.errors.GrammarError as e:
        print(json.dumps(s)[:120], "refused:", str(e)[:250]); continue
    v = jsonschema.Draft202012Validator(s)
    with GrammarState(g, model) as st:
        for val in vals:
            t = json.dumps(val); acc, ok = st.accepts_text(t), v.is_valid(val)
            if acc != ok:
                print(json.dumps(s)[:120], t, f"grammar={acc} jsonschema={ok}", "<-- INVALID ACCEPTED" if acc else "")
    print("checked", json.dumps(s)[:100])
