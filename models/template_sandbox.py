"""A bounded Jinja sandbox: a chat template is code that arrives with a model, so rendering one is
bounded in output size, in what it builds, in loop steps and in time.

:class:`BoundedEnvironment` is Jinja's ``ImmutableSandboxedEnvironment`` (no attribute of Python's
internals, no mutation of its inputs) with every place a template can build something large or run
long going through a check:

* binary ``+``, ``*``, ``%`` and ``**`` (``call_binop``): a string, list or tuple made longer than
  :data:`MAX_CHARS` characters / items, or an integer of more than :data:`MAX_INT_BITS` bits, is
  refused *before* it is made; ``%`` formatting counts its widths and arguments;
* calls (``call``): ``str.center`` / ``ljust`` / ``rjust`` / ``zfill`` / ``expandtabs`` / ``replace``
  / ``join`` / ``format`` are sized before they run, every result after;
* every filter, wrapped: those that can amplify (``center``, ``indent``, ``replace``, ``join``,
  ``wordwrap``, ``tojson``, ``pprint``, ``format``, ``batch``, ``slice``, ``sum``, ...) sized from
  their arguments first; those that turn a value into text measure it first (a list of one string
  repeated is small in memory and huge as text);
* ``~`` concatenation, slices, macro / block bodies (``environment.concat``) and every ``{{ }}``
  output (``finalize``) are measured;
* ``range`` holds at most :data:`MAX_RANGE` numbers, and each step of every ``{% for %}`` counts
  against :data:`MAX_LOOP_STEPS` and checks the deadline.

:func:`render_bounded` renders through ``Template.generate``, summing the chunks against
:data:`MAX_CHARS`, with a deadline of :data:`RENDER_TIMEOUT_S` seconds that every hook checks; what a
render builds in all counts against :data:`BUDGET`. A limit reached is a :class:`TemplateLimit`
(a Jinja ``SecurityError``) with one line saying which.
"""

from __future__ import annotations

import re
import string
import threading
import time
from collections.abc import Iterator

import jinja2
import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg

MAX_CHARS = 1 << 22  # one string's characters or one list's items, and the rendered prompt
BUDGET = 16 * MAX_CHARS  # characters and items one render may build, all together
MAX_INT_BITS = 1 << 16
MAX_RANGE = 100_000  # numbers in one range(), as Jinja's own sandbox
MAX_LOOP_STEPS = 10_000_000  # {% for %} steps in one render
RENDER_TIMEOUT_S = 5.0  # read at each render
MAX_STRFTIME_FORMAT = 256
FIX = "fix or replace the model's chat template"

_state = threading.local()  # the render in progress on this thread (hooks run on the rendering thread)


class TemplateLimit(jinja2.exceptions.SecurityError):
    """A chat template went past one of the sandbox's bounds."""


class _Render:
    def __init__(self, timeout_s: float):
        self.timeout_s, self.deadline = timeout_s, time.monotonic() + timeout_s
        self.built = self.steps = 0


def check_time() -> None:
    render = getattr(_state, "render", None)
    if render is not None and time.monotonic() > render.deadline:
        raise TemplateLimit(f"rendering took longer than {render.timeout_s:g} s; {FIX}")


def reserve(n: int, what: str) -> None:
    """Refuse ``what`` when it would make ``n`` characters / items, over one value's cap or the render's budget."""
    if n > MAX_CHARS:
        raise TemplateLimit(f"{what} would make {n:,} characters or items, over the limit of {MAX_CHARS:,}; {FIX}")
    render = getattr(_state, "render", None)
    if render is not None:
        render.built += n
        if render.built > BUDGET:
            raise TemplateLimit(f"the template built more than {BUDGET:,} characters and items in all; {FIX}")


def measure(value, limit: int = MAX_CHARS) -> tuple[int, int, int]:
    """(characters, items, depth) of ``value`` as text, about; stops once past ``limit`` (shared and
    repeated references counted each time, as ``str`` writes them; no recursion)."""
    chars = items = depth = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        depth = max(depth, d)
        if isinstance(v, (str, bytes)):
            chars += len(v) + 2
        elif isinstance(v, Namespace):
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), d + 1))
            chars += 12
        elif isinstance(v, dict):
            items, chars = items + len(v), chars + 2 + 4 * len(v)
            if chars + items <= limit:
                stack.extend((x, d + 1) for kv in v.items() for x in kv)
        elif isinstance(v, (list, tuple, set, frozenset)):
            items, chars = items + len(v), chars + 2 + 2 * len(v)
            if chars + items <= limit:
                stack.extend((x, d + 1) for x in v)
        elif isinstance(v, int):
            chars += v.bit_length() // 3 + 2
        else:
            chars += 8
        if chars + items > limit:
            break
    return chars, items, depth


def text_size(value) -> int:
    """About how many characters ``str(value)`` makes."""
    return len(value) if isinstance(value, str) else sum(measure(value)[:2])


def check_text(value, what: str) -> None:
    if not isinstance(value, str):
        n = sum(measure(value)[:2])
        if n > MAX_CHARS:
            raise TemplateLimit(f"{what} would write a value of over {MAX_CHARS:,} characters as text; {FIX}")


def shallow(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _int(value) -> int:
    return abs(value) if isinstance(value, int) else 0


def _widths(numbers) -> int:
    """The sum of widths / precisions written in a format (a run of more than 9 digits counts as too many)."""
    return sum(int(n) if len(n) <= 9 else MAX_CHARS + 1 for n in numbers)


PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def percent_size(fmt, args) -> int:
    """About what ``fmt % args`` makes: the format, its widths, the arguments as text and their integers (``%*d``)."""
    widths = _widths(n for m in PERCENT_SPEC.finditer(fmt) for n in m.groups() if n and n != "*")
    values = args if isinstance(args, tuple) else (args,)
    return len(fmt) + widths + text_size(args) + sum(_int(v) for v in values)


def format_size(fmt: str, args, kwargs) -> int:
    """About what ``fmt.format(*args, **kwargs)`` makes (widths in nested fields come from the arguments)."""
    try:
        specs = [spec or "" for _, _, spec, _ in string.Formatter().parse(fmt)]
    except ValueError:
        specs = []
    widths = _widths(n for spec in specs for n in re.findall(r"\d+", spec))
    values = (*args, *kwargs.values())
    return len(fmt) + widths + text_size(values) + sum(_int(v) for v in values)


def replace_size(s, old, new, count=-1) -> int:
    if not isinstance(s, (str, bytes)) or not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return text_size(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(len(new) - len(old), 0)


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _indent_size(s, width=4, first=False, blank=False) -> int:
    pad = len(width) if isinstance(width, str) else _int(width)
    lines = s.count("\n") + 1 if isinstance(s, str) else text_size(s)
    return text_size(s) + lines * pad


def _wordwrap_size(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True) -> int:
    n = text_size(s)
    breaks = n // max(_int(width), 1) + (s.count("\n") if isinstance(s, str) else n) + 1
    return n + breaks * len(wrapstring if isinstance(wrapstring, str) else "\n")


def _json_size(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> int:
    chars, items, depth = measure(value)
    pad = len(indent) if isinstance(indent, str) else _int(indent)
    seps = sum(len(s) for s in separators if isinstance(s, str)) if isinstance(separators, (list, tuple)) else 2
    return chars + items * (seps + 2 + pad * depth)


def _pprint_size(value) -> int:
    chars, items, depth = measure(value)
    return chars + items * (depth + 2)


def _join_size(value, d="", attribute=None) -> int:
    return text_size(value) + len(str(d)) * shallow(value) if isinstance(d, str) else text_size(value)


def _sum_size(value, attribute=None, start=0) -> int:
    """sum() of strings or lists copies every partial result: about n times the total."""
    if not isinstance(value, (list, tuple)) or not any(isinstance(x, (str, list, tuple)) for x in value):
        return 0
    return len(value) * sum(shallow(x) for x in value)


# filters that may make much more than they read, sized from their arguments before they run
FILTER_SIZES = {
    "center": lambda v, width=80: max(text_size(v), _int(width)),
    "indent": _indent_size,
    "replace": lambda s, old, new, count=None: replace_size(s, old, new, -1 if count is None else count),
    "join": _join_size,
    "wordwrap": _wordwrap_size,
    "tojson": _json_size,
    "pprint": _pprint_size,
    "format": lambda v, *args, **kwargs: percent_size(v, args or kwargs) if isinstance(v, str) else text_size(v),
    "batch": lambda v, linecount, fill_with=None: shallow(v) + _int(linecount),
    "slice": lambda v, slices, fill_with=None: shallow(v) + _int(slices),
    "truncate": lambda s, length=255, killwords=False, end="...", leeway=None: text_size(s) + text_size(end),
    "sum": _sum_size,
}
# filters that rearrange or pick from a value without writing it as text (not measured before they run)
STRUCTURAL_FILTERS = {"abs", "attr", "count", "d", "default", "dictsort", "first", "float", "groupby", "int", "items",
                      "last", "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse",
                      "round", "select", "selectattr", "sort", "unique"}
# filters whose value must be a list to be sized (a generator is read into one first)
MATERIALIZE = {"join", "sum", "tojson", "pprint", "batch", "slice"}

# str / bytes (and int) methods that may make much more than they read
METHOD_SIZES = {
    "center": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "ljust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "rjust": lambda s, width, fillchar=" ": max(len(s), _int(width)),
    "zfill": lambda s, width: max(len(s), _int(width)),
    "expandtabs": lambda s, tabsize=8: len(s) + s.count("\t" if isinstance(s, str) else b"\t") * _int(tabsize),
    "replace": replace_size,
    "join": lambda s, items: text_size(items) + len(s) * shallow(items),
    "to_bytes": lambda n, length=1, byteorder="big", *, signed=False: _int(length),  # an int's
}


def binop_size(op: str, left, right) -> int:
    """What ``left op right`` would make (characters / items); refuses integers over MAX_INT_BITS."""
    seqs = (str, bytes, list, tuple)
    if op == "*":
        if isinstance(left, seqs) and isinstance(right, int):
            return len(left) * max(right, 0)
        if isinstance(right, seqs) and isinstance(left, int):
            return len(right) * max(left, 0)
        if isinstance(left, int) and isinstance(right, int):
            _check_bits(left.bit_length() + right.bit_length())
    elif op == "+" and isinstance(left, seqs) and isinstance(right, seqs):
        return len(left) + len(right)
    elif op == "%" and isinstance(left, (str, bytes)):
        return percent_size(left if isinstance(left, str) else left.decode("latin-1"), right)
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        _check_bits(max(left.bit_length() - 1, 0) * right if right <= MAX_INT_BITS else MAX_INT_BITS + 1)
    return 0


def _check_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimit(f"an integer of about {bits:,} bits, over the limit of {MAX_INT_BITS:,}; {FIX}")


def bounded_range(*args) -> range:
    numbers = range(*args)
    try:
        n = len(numbers)
    except OverflowError:
        n = MAX_RANGE + 1
    if n > MAX_RANGE:
        raise TemplateLimit(f"range() of {n:,} or more numbers, over the limit of {MAX_RANGE:,}; {FIX}")
    return numbers


def check_strftime_format(fmt) -> None:
    """strftime_now's format: a short string with no field widths (``%2000000000Y``)."""
    if not isinstance(fmt, str) or len(fmt) > MAX_STRFTIME_FORMAT or re.search(r"%[-_0^#]*\d", fmt):
        raise TemplateLimit(f"strftime_now takes a format of up to {MAX_STRFTIME_FORMAT} characters without field "
                            f"widths, not {str(fmt)[:40]!r}...; {FIX}")


def _loop_steps(iterable) -> Iterator:
    render = getattr(_state, "render", None)
    for item in iterable:
        if render is not None:
            render.steps += 1
            if render.steps > MAX_LOOP_STEPS:
                raise TemplateLimit(f"the template's loops ran more than {MAX_LOOP_STEPS:,} steps; {FIX}")
            if time.monotonic() > render.deadline:
                check_time()
        yield item


def _finalize(value):
    """Every ``{{ }}`` output, measured before it becomes text."""
    check_time()
    check_text(value, "an output")
    return value


def _guarded(node) -> bool:
    return isinstance(node, nodes.Call) and isinstance(node.node, nodes.EnvironmentAttribute) \
        and node.node.name == "loop_steps"


class BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with loops, ``~`` and slices going through the environment's checks."""

    def visit_For(self, node, frame) -> None:
        if not _guarded(node.iter):  # the iterable, stepped through environment.loop_steps
            node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_steps", lineno=node.iter.lineno), [node.iter], [],
                                   None, None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node, frame) -> None:
        if frame.eval_ctx.volatile:
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.concat_values({join}, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node, frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            return super().visit_Getitem(node, frame)
        self.write("environment.slice_item(")
        self.visit(node.node, frame)
        self.write(", slice(")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the bounds of this module; ``filters`` and ``globals`` are added to
    Jinja's own, every filter wrapped (see the module docstring)."""

    code_generator_class = BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, *, filters: dict | None = None, globals: dict | None = None, **options):
        super().__init__(finalize=_finalize, **options)
        self.filters.update(filters or {})
        self.filters = {name: guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # lorem ipsum of any length: no chat template needs it
        self.globals.update(globals or {})
        self.globals["range"] = bounded_range
        self.concat = self.concat_parts  # macro, block and {% set %} bodies: the generated code's concat

    def call_binop(self, context, operator, left, right):
        check_time()
        size = binop_size(operator, left, right)
        if size:
            reserve(size, f"{type(left).__name__} {operator} {type(right).__name__}")
        result = self.binop_table[operator](left, right)
        if isinstance(result, int):
            _check_bits(result.bit_length())
        return result

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        check_time()
        name = getattr(__obj, "__name__", "")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, int)) and name in METHOD_SIZES and not isinstance(__obj, type):
            if name == "join" and args and not isinstance(args[0], (list, tuple)):
                args = (list(args[0]), *args[1:])
            try:
                size = METHOD_SIZES[name](owner, *args, **kwargs)
            except TypeError:
                size = 0  # a wrong call: the method itself says how
            reserve(size, f"{type(owner).__name__}.{name}()")
        result = super().call(__context, __obj, *args, **kwargs)
        if not isinstance(__obj, jinja2.runtime.Macro):  # a macro's body was counted as it was joined
            reserve(shallow(result), f"{name or 'a call'}()")
        return result

    def wrap_str_format(self, value):
        format_ = super().wrap_str_format(value)
        if format_ is None:
            return None
        fmt = value.__self__

        def bounded(*args, **kwargs):
            check_time()
            if value.__name__ == "format_map":
                size = format_size(fmt, (), args[0] if args and isinstance(args[0], dict) else {})
            else:
                size = format_size(fmt, args, kwargs)
            reserve(size, f"str.{value.__name__}()")
            return format_(*args, **kwargs)

        return bounded

    def loop_steps(self, iterable) -> Iterator:
        return _loop_steps(iterable)

    def concat_values(self, join, values: tuple) -> str:
        check_time()
        reserve(sum(text_size(v) for v in values), "the ~ operator")
        return join(values)

    def concat_parts(self, parts) -> str:
        out, total = [], 0
        for part in parts:
            total += len(part)
            if total > MAX_CHARS:
                reserve(total, "a macro or block body")
            out.append(part)
        check_time()
        reserve(total, "a macro or block body")
        return "".join(out)

    def slice_item(self, obj, index: slice):
        check_time()
        result = obj[index]
        if result is not obj:
            reserve(shallow(result), "a slice")
        return result


def guard_filter(name: str, func):
    """``func`` (a Jinja filter) sized before it runs (FILTER_SIZES, or its value measured as text unless it
    is structural) and its result counted after."""
    pass_arg = _PassArg.from_obj(func)
    size = FILTER_SIZES.get(name)

    @jinja2.pass_context
    def guarded(context, value, *args, **kwargs):
        check_time()
        if name in MATERIALIZE and isinstance(value, Iterator):
            value = list(value)
        if size is not None:
            try:
                n = size(value, *args, **kwargs)
            except TypeError:
                n = 0  # a wrong call: the filter itself says how
            reserve(n, f"the filter {name!r}")
        elif name not in STRUCTURAL_FILTERS:
            check_text(value, f"the filter {name!r}")
        lead = {_PassArg.context: (context,), _PassArg.eval_context: (context.eval_ctx,),
                _PassArg.environment: (context.environment,)}.get(pass_arg, ())
        result = func(*lead, value, *args, **kwargs)
        if result is not value:
            reserve(shallow(result), f"the filter {name!r}")
        return result

    guarded.__name__ = getattr(func, "__name__", name)
    return guarded


def render_bounded(template: jinja2.Template, variables: dict, timeout_s: float | None = None) -> str:
    """``template`` rendered with ``variables`` under this module's bounds (a TemplateLimit past one)."""
    previous = getattr(_state, "render", None)
    render = _state.render = _Render(RENDER_TIMEOUT_S if timeout_s is None else timeout_s)
    try:
        parts, total = [], 0
        for chunk in template.generate(**variables):
            total += len(chunk)
            if total > MAX_CHARS:
                raise TemplateLimit(f"the rendered prompt is longer than {MAX_CHARS:,} characters; {FIX}")
            if time.monotonic() > render.deadline:
                check_time()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _state.render = previous
