#!/usr/bin/env python3
"""Checks the C API rules of include/kvreplay.h (run by scripts/test.sh).

Naming: every function is kvr_<object>_<verb>, where <object> is the full name of one of
the header's types (kvr_kv_pool -> kv_pool, kvr_gdn_pool_params -> gdn_pool_params, ...)
or one of PSEUDO_OBJECTS, and <verb> is what follows it (non-empty, lower-case). A function
of an opaque handle type (kvr_context, kvr_kv_pool, ...) takes that handle first, except
its constructors (new, open), which return it last.

Documentation: every function's comment has the lines
  Returns: ...        (every status it can return, or the value it returns)
  Ownership: ...
  Thread safety: ...
  On failure: ...     (the state of the objects after a failure)
every status it names exists, and a function returning kvr_status lists KVR_STATUS_OK and
is KVR_NODISCARD. Every typedef, struct, struct field and #define has a comment.

Named values: a #define is either a value of one of the header's integer typedefs, written
((kvr_<type>)N), or a non-negative limit (KVR_MAX_DIMS); no bare negative numbers.

Usage: scripts/check-header-docs.py [HEADER]   (default: include/kvreplay.h)
Exits 1 and names every declaration that breaks a rule.
"""

import os
import re
import sys

# Objects that are not types: the library itself, the CUDA driver, the calling thread's
# last error.
PSEUDO_OBJECTS = {"library", "cuda", "error"}
# Constructors of handle types: they return the handle instead of taking it first.
CONSTRUCTORS = {"new", "open"}
DOC_LINES = ("Returns:", "Ownership:", "Thread safety:", "On failure:")
# Macros that are not API values: the include guard, the attribute macro, and the version
# expression built from the version macros.
MACRO_ALLOW = {"KVREPLAY_H", "KVR_NODISCARD", "KVR_VERSION_NUMBER"}


def parse(path):
    """Returns (decls, typedefs, opaque): decls are dicts with kind, name, line, doc and
    per kind: value (define), fields (struct), ret/params/nodiscard (function)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    decls, typedefs, opaque = [], {}, set()
    doc, i, in_extern = None, 0, False

    def take_doc(i):
        block = []
        while True:
            block.append(lines[i])
            if "*/" in lines[i]:
                break
            i += 1
        text = []
        for raw in block:
            s = raw.strip()
            s = re.sub(r"^/\*\*\s?", "", s)
            s = re.sub(r"\s?\*/$", "", s)
            s = re.sub(r"^\*\s?", "", s)
            text.append(s)
        return "\n".join(text).strip(), i + 1

    while i < len(lines):
        s = lines[i].strip()
        lineno = i + 1
        if s.startswith("/**"):
            doc, i = take_doc(i)
            continue
        if s.startswith('extern "C" {'):
            in_extern = True
        elif s.startswith("#define "):
            parts = s.split(None, 2)
            decls.append({"kind": "define", "name": parts[1], "line": lineno, "doc": doc,
                          "value": parts[2] if len(parts) > 2 else ""})
        elif s.startswith("typedef struct") and s.endswith("{"):
            name = s.split()[2]
            fields, fdoc, i = [], None, i + 1
            while not lines[i].strip().startswith("}"):
                t = lines[i].strip()
                if t.startswith("/**"):
                    fdoc, i = take_doc(i)
                    continue
                m = re.match(r"^(.*?)\b(\w+)(\[[^\]]*\])?;$", t)
                if m:
                    fields.append({"name": m.group(2), "line": i + 1, "doc": fdoc})
                fdoc, i = None, i + 1
            decls.append({"kind": "struct", "name": name, "line": lineno, "doc": doc,
                          "fields": fields})
            typedefs[name] = "struct"
        elif s.startswith("typedef struct"):
            m = re.match(r"^typedef struct (\w+) (\w+);$", s)
            name = m.group(2)
            decls.append({"kind": "opaque", "name": name, "line": lineno, "doc": doc})
            typedefs[name] = "struct"
            opaque.add(name)
        elif s.startswith("typedef "):
            m = re.match(r"^typedef (\w+) (\w+);$", s)
            if not m:
                raise SystemExit(f"{path}:{lineno}: cannot parse '{s}'")
            decls.append({"kind": "typedef", "name": m.group(2), "line": lineno, "doc": doc})
            typedefs[m.group(2)] = m.group(1)
        elif in_extern and s and (s[0].isalpha() or s[0] == "_") and not s.startswith("}"):
            text = s
            while not text.endswith(";"):
                i += 1
                text += " " + lines[i].strip()
            m = re.match(r"^(KVR_NODISCARD\s+)?(.*?)\b(kvr_\w+)\((.*)\);$", text)
            if not m:
                raise SystemExit(f"{path}:{lineno}: cannot parse '{text}'")
            decls.append({"kind": "function", "name": m.group(3), "line": lineno, "doc": doc,
                          "nodiscard": bool(m.group(1)), "ret": m.group(2).strip(),
                          "params": [p.strip() for p in m.group(4).split(",") if p.strip()]})
        if not s.startswith("/**"):
            doc = None
        i += 1
    return decls, typedefs, opaque


def check(path):
    decls, typedefs, opaque = parse(path)
    errors = []
    objects = {t[len("kvr_"):] for t in typedefs if t.startswith("kvr_")} | PSEUDO_OBJECTS
    statuses = {d["name"] for d in decls if d["kind"] == "define"
                and d["name"].startswith("KVR_STATUS_")}
    ints = {n for n, base in typedefs.items() if re.match(r"^u?int\d+_t$", base)}

    def err(d, msg):
        errors.append(f"{path}:{d['line']}: {d['name']}: {msg}")

    for d in decls:
        if d["kind"] == "define":
            if d["name"] in MACRO_ALLOW:
                continue
            if not d["doc"]:
                err(d, "macro without a doc comment")
            v = d["value"]
            m = re.match(r"^\(\((kvr_\w+)\)(-?\d+)\)$", v)
            if m:
                if m.group(1) not in ints:
                    err(d, f"value cast to '{m.group(1)}', which is not an integer typedef "
                           "of this header")
            elif not re.match(r"^\d+$", v):
                err(d, f"value '{v}' is neither ((kvr_<type>)N) nor a non-negative limit "
                       "(declare it `N as kvr_<type>` in src/ffi)")
        elif d["kind"] in ("typedef", "opaque", "struct"):
            if not d["doc"]:
                err(d, "type without a doc comment")
            for f in d.get("fields", []):
                if not f["doc"]:
                    errors.append(f"{path}:{f['line']}: {d['name']}.{f['name']}: field "
                                  "without a doc comment")
        elif d["kind"] == "function":
            name = d["name"]
            rest = name[len("kvr_"):]
            obj = max((o for o in objects if rest.startswith(o + "_")), key=len, default=None)
            verb = rest[len(obj) + 1:] if obj else ""
            if obj is None or not re.match(r"^[a-z][a-z0-9_]*$", verb):
                err(d, "breaks kvr_<object>_<verb>: it does not start with the full name of "
                       "a type of this header (or library, cuda, error) followed by a verb")
            elif "kvr_" + obj in opaque and verb not in CONSTRUCTORS:
                first = d["params"][0] if d["params"] else ""
                if not re.search(rf"\bkvr_{obj}\s*\*", first):
                    err(d, f"a kvr_{obj} function must take the kvr_{obj} handle first "
                           f"(got '{first or 'void'}')")
            doc = d["doc"] or ""
            for key in DOC_LINES:
                if not re.search(rf"^{key}\s*\S", doc, re.M):
                    err(d, f"doc comment lacks a '{key}' line")
            for s in set(re.findall(r"\bKVR_STATUS_\w+", doc)) - statuses:
                err(d, f"doc comment names {s}, which is not a status")
            if d["ret"] == "kvr_status":
                if not d["nodiscard"]:
                    err(d, "returns kvr_status but is not KVR_NODISCARD (add #[must_use])")
                returns = re.search(r"^Returns:(.*?)(?=^\w[\w ]*:|\Z)", doc, re.M | re.S)
                if returns and "KVR_STATUS_OK" not in returns.group(1):
                    err(d, "the 'Returns:' line does not list KVR_STATUS_OK")
    n_fn = sum(d["kind"] == "function" for d in decls)
    return errors, n_fn, len(decls)


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(root, "include", "kvreplay.h")
    errors, n_fn, n_decl = check(path)
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        print(f"check-header-docs: {len(errors)} problem(s); fix the doc comments or names in "
              "src/ffi and run scripts/gen-header.sh", file=sys.stderr)
        return 1
    print(f"check-header-docs: {n_fn} functions and {n_decl - n_fn} other declarations "
          "follow the naming and documentation rules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
