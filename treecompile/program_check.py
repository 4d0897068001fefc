"""Check a saved ``program.pt2`` before torch reads it: the archive may hold data, never code.

``torch.export.load`` runs code from a .pt2 in several places (torch 2.11-2.13):

- weights or constants whose payload config says ``use_pickle``: ``torch.load(weights_only=False)``;
- constants named ``custom_obj_*`` / ``opaque_obj_*``: ``torch._C._pickle_load_obj`` / ``pickle.loads``;
- ``data/sample_inputs/<model>.pt``: ``torch.load(weights_only=True)``, and on failure ``weights_only=False``;
- legacy entries (``data/weights/<model>.pt``, the pre-2.8 ``serialized_*.pt`` layout, read when the
  new layout fails) and ``data/aotinductor/`` (shared libraries);
- symbolic shapes in the graph JSON (``expr_str``) go through ``sympy.sympify``, which is ``eval``;
- a node target ``torch.<any.attribute.path>`` resolves to any attribute of torch (``torch.os.system``)
  and is called when the graph runs; ``guards_code`` is Python source that ``ep.module()`` executes.

:func:`check_program` reads the archive with torch's own zip reader, from the same bytes that are then
handed to ``torch.export.load``, and accepts only what is data (an allowlist, not a denylist):

- entries: the archive markers (``archive_format``, ``archive_version``, ``byteorder``, ``.data/version``,
  ``.data/serialization_id``), ``models/model.json``, the two payload configs (JSON), raw tensor bytes
  ``data/weights/weight_<i>`` / ``data/constants/tensor_<i>``, and an *empty* ``data/sample_inputs/model.pt``;
- payload configs: every entry ``use_pickle: false`` with tensor metadata, naming an existing raw entry;
- names: every graph value, node, input, output and argument name is a Python identifier, every parameter/buffer
  /constant name a dotted path of identifier characters (FX writes placeholder names into the ``forward`` it
  ``exec``s: a name holding code ran at load); no string holds a carriage return, and only stack traces a newline;
- graph: node targets and operator arguments are ``torch.ops.aten`` / ``torch.ops.treecompile`` ops (ops
  with string arguments only where the string is a mode: ``aten.save`` and ``aten.from_file`` are
  refused), a few ``_operator`` / ``math`` / ``torch.sym_*`` functions, the grad-mode/autocast wrappers
  (their subgraphs checked the same way); no custom objects; symbolic
  expressions and guards match a small grammar (sympy constructors, symbol names, integers of at most 19 digits;
  no powers or shifts, whose evaluation by sympy at load can take forever).

Anything else raises :class:`UnsafeProgramError` naming the entry (and node) that was refused
("refused: ..."), or saying that the archive cannot be read at all ("cannot load the archive ...").
"""

from __future__ import annotations

import io
import json
import re
import zipfile

__all__ = ["check_program", "UnsafeProgramError"]

MODEL = "model"  # torch.export.save writes one program under this name
MARKERS = {"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id"}
GRAPH = f"models/{MODEL}.json"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"
CONFIGS = {"data/weights/": (f"data/weights/{MODEL}_weights_config.json", "weight_"),
           "data/constants/": (f"data/constants/{MODEL}_constants_config.json", "tensor_")}
RAW = re.compile(r"data/(weights/weight|constants/tensor)_\d+")

OP_NAMESPACES = ("torch.ops.aten.", "torch.ops.treecompile.")
# aten ops whose string arguments are modes (rounding_mode, approximate, reduce, equation, ...)
STRING_MODE_OPS = {"gelu", "gelu_backward", "div", "div_", "einsum", "pad", "scatter", "scatter_",
                   "scatter_reduce", "scatter_reduce_", "index_reduce", "index_reduce_", "_assert_async",
                   "_assert_scalar", "_functional_assert_async", "_functional_assert_scalar", "linalg_norm",
                   "linalg_matrix_norm", "linalg_cond", "linalg_eigh", "linalg_eigvalsh", "linalg_qr",
                   "_linalg_eigh", "quantile", "nanquantile", "segment_reduce", "_segment_reduce_backward",
                   "conv1d", "conv2d", "conv3d", "_convolution_mode", "searchsorted", "bucketize"}
PY_FUNCTIONS = {f"_operator.{n}" for n in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod",
                                           "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_",
                                           "not_", "pos", "abs")} | \
               {f"math.{n}" for n in ("ceil", "floor", "trunc", "sqrt")} | \
               {f"torch.{n}" for n in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite",
                                       "sym_sqrt", "sym_sum")}

# higher-order ops that only change a mode around a subgraph (HF's @torch.no_grad rotary embedding)
HIGHER_ORDER = {"torch.ops.higher_order.wrap_with_set_grad_enabled", "torch.ops.higher_order.wrap_with_autocast"}

# sympy's srepr, as torch writes expr_str: Mul(Integer(16), Symbol('s34', positive=True, integer=True))
SYMPY_NAMES = {"Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "PowByNatural", "Max", "Min", "Mod",
               "Eq", "Ne",
               "Lt", "Le", "Gt", "Ge", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan",
               "Equality", "Unequality", "And", "Or", "Not", "Abs", "floor", "ceiling", "oo", "zoo", "nan",
               "true", "false", "True", "False", "BooleanTrue", "BooleanFalse", "Infinity", "NegativeInfinity",
               "IntInfinity", "NegativeIntInfinity", "FloorDiv", "ModularIndexing", "Where", "PythonMod",
               "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "RShift",
               "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat", "TruncToInt",
               "RoundToInt", "RoundDecimal", "ToFloat", "Identity"}
# (``**``, FloatPow and LShift are left out and Pow/PowByNatural take a literal exponent of at most MAX_EXPONENT
# with no power inside them (:func:`_check_powers`): sympy evaluates powers when it reads the expression, and
# ``Integer(9)**Integer(9)**Integer(9)`` held load for minutes; integers are capped at 19 digits)
EXPR_TOKEN = re.compile(r"\s+|[A-Za-z][A-Za-z0-9_]*\s*=(?!=)|[A-Za-z][A-Za-z0-9]*|'[A-Za-z_][A-Za-z0-9_]*'"
                        r"|\d{1,19}(?:\.\d{1,19})?(?:[eE][+-]?\d{1,3})?(?![0-9.])|\*(?!\*)|[-+/(),]")
MAX_EXPONENT = 64  # T**2 of a flattened [T, T] mask is what torch writes
POWER_CALL = re.compile(r"\b(Pow|PowByNatural)\(")
LITERAL_EXPONENT = re.compile(r"\s*Integer\(\s*(\d{1,19})\s*\)\s*")
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
DOTTED = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")  # parameter/buffer FQNs (``layers.0.weight``)
NAME_KEYS = ("name", "as_name")  # graph value, node and argument names
VALUE_TABLES = ("tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values")
# guards: L['input_ids'].size()[1] == L['tree']['position_ids'].size()[0]
GUARD_TOKEN = re.compile(r"\s+|L(?:\['[A-Za-z_][A-Za-z0-9_]*'\]|\[\d+\])+(?:\.(?:size|stride)\(\)\[\d+\]"
                         r"|\.storage_offset\(\))?|\d+|==|!=|<=|>=|<|>|//|[-+*%()]|and\b|or\b|not\b")


class UnsafeProgramError(ValueError):
    """The archive holds something other than data (a pickle, code, an unknown entry); names the entry."""


def check_program(data: bytes) -> None:
    """Raise :class:`UnsafeProgramError` unless the .pt2 archive ``data`` holds only data (see module doc).
    A damaged archive (zip headers, encrypted or unsupported entries) is "cannot load the archive (...)"."""
    try:
        _check_program(data)
    except UnsafeProgramError:
        raise
    except Exception as e:  # zipfile's and torch's readers raise their own types on damaged headers
        raise UnsafeProgramError(f"cannot load the archive ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _check_program(data: bytes) -> None:
    import torch

    names = _zip_names(data)
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        records = set(reader.get_all_records())
    except Exception as e:
        raise UnsafeProgramError(f"cannot load the archive ({str(e).splitlines()[0] if str(e) else e!r})") from None
    if records != names:
        raise UnsafeProgramError(f"the zip directory and torch's reader disagree on the entries "
                                 f"({sorted(records ^ names)[:3]})")
    for name in sorted(records):
        if name not in MARKERS | {GRAPH, SAMPLE_INPUTS} and name not in (c for c, _ in CONFIGS.values()) \
                and not RAW.fullmatch(name):
            raise UnsafeProgramError(f"entry {name!r} is not one a treecompile program holds "
                                     f"(allowed: markers, {GRAPH}, payload configs, raw tensor bytes)")
    for need in (GRAPH, SAMPLE_INPUTS, *(c for c, _ in CONFIGS.values())):
        if need not in records:
            raise UnsafeProgramError(f"entry {need!r} is missing")
    if reader.get_record_size(SAMPLE_INPUTS) != 0:
        raise UnsafeProgramError(f"entry {SAMPLE_INPUTS!r} holds a pickle (torch.save'd example inputs); "
                                 f"a treecompile program stores none")
    for base, (config, prefix) in CONFIGS.items():
        _check_payload_config(reader, records, base, config, prefix)
    _check_graph(_json(reader, GRAPH))


def _zip_names(data: bytes) -> set[str]:
    """Entry names under the archive's one root folder; duplicates and other roots are refused."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise UnsafeProgramError(f"cannot load the archive: not a zip ({e})") from None
    full = zf.namelist()
    roots = {n.split("/", 1)[0] for n in full}
    if len(roots) != 1 or any("/" not in n for n in full):
        raise UnsafeProgramError(f"expected one root folder in the archive, got {sorted(roots)[:3]}")
    if len(set(full)) != len(full):
        dup = next(n for n in full if full.count(n) > 1)
        raise UnsafeProgramError(f"entry {dup.split('/', 1)[1]!r} appears twice")
    # torch's writer stores every entry as is: a compressed one could inflate to any size when read (1 MB of
    # archive to a 1 GiB graph), so the archive's own size bounds what reading it costs
    packed = next((i for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise UnsafeProgramError(f"entry {packed.filename.split('/', 1)[1]!r} is compressed ({packed.file_size:,} "
                                 f"bytes from {packed.compress_size:,}); torch.export.save stores its entries "
                                 "uncompressed")
    return {n.split("/", 1)[1] for n in full}


def _json(reader, name: str):
    try:
        return json.loads(reader.get_record(name))
    except (ValueError, UnicodeDecodeError) as e:
        raise UnsafeProgramError(f"entry {name!r}: invalid JSON ({e})") from None


def _check_payload_config(reader, records: set, base: str, config: str, prefix: str) -> None:
    cfg = _json(reader, config)
    entries = cfg.get("config") if isinstance(cfg, dict) else None
    if not isinstance(entries, dict):
        raise UnsafeProgramError(f"entry {config!r}: expected {{\"config\": {{...}}}}")
    for fqn, meta in entries.items():
        if not isinstance(meta, dict):
            raise UnsafeProgramError(f"entry {config!r}: {fqn}: expected an object")
        path = meta.get("path_name")
        where = f"entry {base + path!r}" if isinstance(path, str) else f"entry {config!r}"
        if meta.get("use_pickle") is not False:
            raise UnsafeProgramError(f"{where} ({fqn}) is marked use_pickle: torch would unpickle it "
                                     f"(a treecompile program stores raw tensor bytes only)")
        if not isinstance(path, str) or not re.fullmatch(rf"{prefix}\d+", path) or f"{base}{path}" not in records:
            raise UnsafeProgramError(f"entry {config!r}: {fqn} names payload {path!r}, which is not a raw "
                                     f"{base}{prefix}<i> entry of the archive")
        if not isinstance(meta.get("tensor_meta"), dict):
            raise UnsafeProgramError(f"{where} ({fqn}): no tensor metadata")


def _check_graph(program) -> None:
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise UnsafeProgramError(f"entry {GRAPH!r}: not a serialized ExportedProgram")
    gm = program["graph_module"]
    graph = gm.get("graph")
    if not isinstance(graph, dict) or graph.get("custom_obj_values"):
        raise UnsafeProgramError(f"entry {GRAPH!r}: custom objects are not data")
    _check_names(program, graph)
    _check_nodes(graph)
    for expr in _values(program, "expr_str"):
        _check_tokens(expr, EXPR_TOKEN, "symbolic expression", ident_ok=_sympy_ident)
        _check_powers(expr)
        _check_floats(expr)
    guards = program.get("guards_code") or []
    if not isinstance(guards, list):
        raise UnsafeProgramError(f"entry {GRAPH!r}: guards_code is not a list")
    for g in guards:
        _check_tokens(g, GUARD_TOKEN, "guard", ident_ok=lambda t: True)


def _check_names(program: dict, graph: dict) -> None:
    """Names are identifiers (FX writes them into code it executes), FQNs dotted identifier characters, and no
    string breaks a line of that code (a carriage return ends a Python line; newlines only in stack traces)."""
    def bad(what, value):
        raise UnsafeProgramError(f"entry {GRAPH!r}: {what} {str(value)[:80]!r} is not a name treecompile writes")

    for key in NAME_KEYS:
        for v in _values(program, key):
            # (a higher-order op's positional inputs are named "")
            if not isinstance(v, str) or not (IDENTIFIER.fullmatch(v) or (key == "name" and v == "")):
                bad(f"{key}", v)
    for table in VALUE_TABLES:
        values = graph.get(table) or {}
        if not isinstance(values, dict):
            raise UnsafeProgramError(f"entry {GRAPH!r}: {table} is not a mapping")
        for v in values:
            if not IDENTIFIER.fullmatch(v):
                bad(f"{table} key", v)
    for key, v in _items(program):
        if key.endswith("_name") or key == "fqn":
            if not isinstance(v, str) or not (DOTTED.fullmatch(v) or (key == "fqn" and v == "")):
                bad(key, v)
        if isinstance(v, str) and ("\r" in v or ("\n" in v and key != "stack_trace")):
            bad(f"{key} (a line break)", v)


def _items(obj):
    """Every ``(key, value)`` pair anywhere in a JSON tree (list entries under their list's key)."""
    stack = [("", obj)]
    while stack:
        key, x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.items())
        elif isinstance(x, list):
            stack.extend((key, v) for v in x)
        else:
            yield key, x


def _check_nodes(graph: dict) -> None:
    for node in graph.get("nodes", []):
        name = node.get("name", "?") if isinstance(node, dict) else "?"
        target = node.get("target") if isinstance(node, dict) else None
        _check_target(target, name)
        for op in _values(node.get("inputs", []), "as_operator"):
            _check_target(op, name)
        if next(_values(node, "as_custom_obj"), None) is not None:
            raise UnsafeProgramError(f"entry {GRAPH!r}: node {name} takes a custom object (not data)")
        for sub in _values(node.get("inputs", []), "as_graph"):
            if not isinstance(sub, dict) or not isinstance(sub.get("graph"), dict):
                raise UnsafeProgramError(f"entry {GRAPH!r}: node {name}: malformed subgraph")
            _check_nodes(sub["graph"])


def _check_target(target, node: str) -> None:
    import torch

    import treecompile.ops  # noqa: F401 - registers the tree ops a program names (inspect/verify read no model)

    bad = f"entry {GRAPH!r}: node {node} calls {target!r}"
    if not isinstance(target, str):
        raise UnsafeProgramError(f"{bad}: not an operator name")
    if target in PY_FUNCTIONS or target in HIGHER_ORDER:  # HOP subgraphs are checked as graphs
        return
    if not target.startswith(OP_NAMESPACES):
        raise UnsafeProgramError(f"{bad}: only torch.ops.aten / torch.ops.treecompile ops (and a few "
                                 f"_operator/math/sym functions) may appear in a saved program")
    parts = target.split(".")
    if len(parts) != 5 or not all(p.isidentifier() and not p.startswith("__") for p in parts):
        raise UnsafeProgramError(f"{bad}: expected torch.ops.<namespace>.<op>.<overload>")
    try:
        overload = getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
        schema = overload._schema
    except (AttributeError, RuntimeError):
        raise UnsafeProgramError(f"{bad}: no such operator is registered") from None
    if parts[2] == "aten" and parts[3] not in STRING_MODE_OPS and any(
            isinstance(a.type, torch.StringType) for a in schema.arguments):
        raise UnsafeProgramError(f"{bad}: an operator with string arguments (file names, messages) is "
                                 f"not allowed in a saved program")


def _call_args(text: str, start: int) -> list[str] | None:
    """The top-level arguments of the call whose ``(`` ends at ``start`` in ``text`` (None if it never closes)."""
    depth, i, args, begin = 1, start, [], start
    while i < len(text) and depth:
        c = text[i]
        depth += (c == "(") - (c == ")")
        if (c == "," and depth == 1) or not depth:
            args.append(text[begin:i])
            begin = i + 1
        i += 1
    return None if depth else args


def _check_floats(text: str) -> None:
    """``Float(x)`` takes one argument: a second one is a decimal precision, and ``str`` of a Float of 10^8 digits
    (torch prints every expression it reads) held load for minutes."""
    for m in re.finditer(r"\bFloat\(", text):
        args = _call_args(text, m.end())
        if args is None or len(args) != 1:
            raise UnsafeProgramError(f"entry {GRAPH!r}: symbolic expression {text[:80]!r}: a Float with a "
                                     f"precision argument is not an expression treecompile writes")


def _check_powers(text: str) -> None:
    """Every ``Pow(base, Integer(k))`` has a literal exponent ``0 <= k <= MAX_EXPONENT`` and no power in its base."""
    for m in POWER_CALL.finditer(text):
        args = _call_args(text, m.end())
        exponent = LITERAL_EXPONENT.fullmatch(args[1]) if args is not None and len(args) == 2 else None
        if exponent is None or int(exponent.group(1)) > MAX_EXPONENT or POWER_CALL.search(args[0]):
            raise UnsafeProgramError(f"entry {GRAPH!r}: symbolic expression {text[:80]!r}: a power whose exponent is "
                                     f"not a literal integer of at most {MAX_EXPONENT} over a base without powers "
                                     f"(sympy would evaluate it when reading the program)")


def _sympy_ident(tok: str) -> bool:
    return tok in SYMPY_NAMES


def _check_tokens(text, pattern: re.Pattern, what: str, *, ident_ok) -> None:
    if not isinstance(text, str):
        raise UnsafeProgramError(f"entry {GRAPH!r}: {what} {text!r} is not a string")
    pos = 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None:
            raise UnsafeProgramError(f"entry {GRAPH!r}: {what} {text[:80]!r} has {text[pos:pos + 20]!r} at "
                                     f"{pos}: not an expression treecompile writes")
        tok = m.group(0)
        bare = tok[0].isalpha() and tok[-1] != "=" and not tok.startswith("L[") and tok not in ("and", "or", "not")
        if bare and not ident_ok(tok):
            raise UnsafeProgramError(f"entry {GRAPH!r}: {what} {text[:80]!r} names {tok!r}, which is not a "
                                     f"sympy constructor")
        pos = m.end()


def _values(obj, key: str):
    """Every value stored under ``key`` anywhere in a JSON tree."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                if k == key:
                    yield v
                stack.append(v)
        elif isinstance(x, list):
            stack.extend(x)
