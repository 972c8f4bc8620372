"""Where an LLM call sits in its workflow: the workflow, the task, and the calls it extends.

`workflow` and `task` keep this in a context variable; the HTTP hooks (`kvgate.sdk.hooks`) read
it when a request is sent and turn it into the gateway's hint headers. Every call a workflow
makes becomes one task of the gateway's hint-mode record (its id: the SDK task's id for the
task's first call, `ID.2`, `ID.3`... for the next ones; `call-N` outside any task).

Parents (`X-KVGate-After`) follow the flow of results, decided per scope (a workflow body or a
task body) from the work finished in it:

- Sequential work chains: a call or task started after another finished, in the same asyncio
  task, has it as parent (a ReAct loop: each turn extends the last).
- Work started together (`asyncio.gather`, `TaskGroup`, `create_task`) runs in asyncio tasks of
  its own; each starts from the parents the scope had when they were created, so siblings share
  their parents (a fan-out), and none of them is a parent of another.
- Work started after a fan-out, where the fan-out was awaited, has all the siblings as parents
  (a join).
- The first call in a task has the task's parents; a task started inside a task that already
  made a call has that call as parent. A task that made no call passes its parents through.

Precisely: a finished unit X (a call, or a task with all it did) is visible to new work in
asyncio task L when X ran in L or in an asyncio task started (directly or not) from L; or,
going up from L to the task that started it, and so on, when the first of those tasks whose
descendants X ran in had X finished before it started the task on L's side. So a join sees
the branches it awaited, and a task started later sees what its starter saw then, but not a
sibling branch's work, however late it is started (a `wait_for` or a nested `gather` in one
branch). Who started a task is recorded when it is created: a workflow installs a task factory
on its event loop (chaining one already set).
The new work's parents are the visible units that no other visible unit extends; with none,
the scope's own parents.
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import functools
import inspect
import itertools
import math
import secrets
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast, overload

from planner.hints import (
    MAX_AFTER,
    MAX_AFTER_HEADER,
    MAX_TOKENS,
    PRIORITY_LIMIT,
    names_a_store_key,
)

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
_T = TypeVar("_T")
_P2 = ParamSpec("_P2")

_Lane = asyncio.Task[Any] | None
"""The asyncio task work runs in (None outside any: the hooks then treat the thread as one)."""


def _current_lane() -> _Lane:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


_clock = itertools.count(1)
"""One order for task creations and finished units."""


@dataclass(frozen=True, slots=True)
class _Birth:
    """Who created an asyncio task, and when (on `_clock`); `serial` names it for good.

    `creator` is the creating task's own birth, not the task: holding the task kept every
    finished task of a chain (each started by the one before) alive for as long as its
    newest lived. A chain longer than the walks go (`MAX_LINEAGE`) starts a new root."""

    creator: _Birth | None
    at: int
    serial: int
    depth: int = 0


MAX_LINEAGE = 10_000
"""How far back a task's creators are followed."""


_births: weakref.WeakKeyDictionary[asyncio.Task[Any], _Birth] = weakref.WeakKeyDictionary()
_factories: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, bool] = \
    weakref.WeakKeyDictionary()


def _install_factory() -> None:
    """Record each task's creator as it is created on the running loop (once per loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if loop in _factories:
        return
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        creator = asyncio.current_task(loop)
        task = (previous(loop, coro, **kwargs) if previous is not None
                else asyncio.Task(coro, loop=loop, **kwargs))
        if isinstance(task, asyncio.Task):
            _births[task] = _born_of(creator)
        return task

    loop.set_task_factory(factory)
    _factories[loop] = True


def _birth(lane: _Lane) -> _Birth | None:
    if lane is None:
        return None
    birth = _births.get(lane)
    if birth is None:
        # Created before the factory was in place (or around it): a root of its own.
        birth = _births[lane] = _Birth(None, 0, next(_clock))
    return birth


def _born_of(creator: _Lane) -> _Birth:
    """The birth of a task `creator` starts now."""
    parent = _birth(creator)
    if parent is not None and parent.depth + 1 >= MAX_LINEAGE:
        parent = None
    return _Birth(parent, next(_clock), next(_clock), parent.depth + 1 if parent else 0)


def _serial(lane: _Lane) -> int:
    """A number for the task that is never reused (0: no task)."""
    birth = _birth(lane)
    return birth.serial if birth is not None else 0


def _lineage(lane: _Lane) -> frozenset[int]:
    """The task and every task that started it, up to a root."""
    out = [_serial(lane)]
    birth = _birth(lane)
    while birth is not None and birth.creator is not None and len(out) < MAX_LINEAGE:
        birth = birth.creator
        out.append(birth.serial)
    return frozenset(out)


@dataclass
class _Unit:
    """A finished call or task of a scope: what later work may extend."""

    seq: int
    ends: tuple[str, ...]
    """The gateway task ids (calls) its result is in."""
    extends: frozenset[int]
    """The units of the same scope it extended (their `seq`)."""
    lane: int
    """The asyncio task it ran in (`_serial`)."""
    finished_at: int
    """When it finished, on `_clock`."""


class _Run:
    """One run of a workflow: its id and the counters that make task ids unique."""

    def __init__(self, workflow_id: str) -> None:
        self.id = workflow_id
        self._names: dict[str, itertools.count[int]] = {}
        self._calls = itertools.count(1)

    def task_id(self, name: str) -> str:
        """`NAME-1`, `NAME-2`, ... in the order the tasks start."""
        counter = self._names.setdefault(name, itertools.count(1))
        return f"{name}-{next(counter)}"

    def loose_call_id(self) -> str:
        """The id of a call made outside any task."""
        return f"{LOOSE_CALL}-{next(self._calls)}"


class _Scope:
    """The body of a workflow or of one task: its parents and the work finished in it."""

    def __init__(self, run: _Run, task_id: str | None, base: tuple[str, ...],
                 expect_children: int | None = None) -> None:
        self.run = run
        self.task_id = task_id
        self.base = base
        """The parents of the scope's first work (the task's own `after`)."""
        self.expect_children = expect_children
        self.units: dict[int, _Unit] = {}
        self._leaves: set[int] = set()
        """Units nothing extends yet (the search for parents starts there)."""
        self._lineages: dict[int, frozenset[int]] = {}
        """Per asyncio task that finished work here, it and the tasks that started it."""
        self._by_lane: dict[int, tuple[list[int], list[int]]] = {}
        """Per asyncio task, its units' finish times and `seq`s, in the order they finished."""
        self._external: dict[int, tuple[list[int], list[int]]] = {}
        """Per asyncio task, the units of other tasks its units extended, with when the
        extending unit finished."""
        self._seq = itertools.count()
        self._calls = 0
        self.open_calls: weakref.WeakKeyDictionary[asyncio.Task[Any], Call] = \
            weakref.WeakKeyDictionary()
        """The call each asyncio task has in flight (a retry reuses its id)."""

    @staticmethod
    def enter(lane: _Lane, came_from: _Lane) -> None:
        """`lane` starts working here; its context was copied from `came_from`'s. A task the
        factory did not see being created is taken as started by `came_from` just now."""
        if lane is not None and lane is not came_from and lane not in _births:
            _births[lane] = _born_of(came_from)

    def _threshold(self, lane_serial: int, lane: _Lane) -> float:
        """New work in `lane` sees the units of the asyncio task `lane_serial` that finished
        before this (`_clock`): all of them (inf) when that task is `lane` or started from it,
        none (-inf) when no task on `lane`'s side descends from its starters."""
        lineage = self._lineages[lane_serial]
        if _serial(lane) in lineage:
            return math.inf
        birth = _birth(lane)
        seen = 0
        while birth is not None and birth.creator is not None and seen < MAX_LINEAGE:
            if birth.creator.serial in lineage:
                return float(birth.at)
            birth = birth.creator
            seen += 1
        return -math.inf

    def parents(self, lane: _Lane) -> tuple[tuple[str, ...], frozenset[int]]:
        """What new work in `lane` extends: the gateway task ids, and the units they are.

        The walk starts at the units nothing extends and goes back through the ones `lane`
        cannot see. What `lane` sees of one asyncio task's units is those finished before a
        time (`_threshold`), so an unseen unit takes the walk at once to the last seen unit of
        its task and to the units outside it that the task's unseen ones extended: the cost
        is the number of asyncio tasks that worked here, not their history. The visible
        units reached that no other reached one extends are the parents."""
        thresholds: dict[int, float] = {}
        found: list[_Unit] = []
        stack = sorted(self._leaves)
        seen: set[int] = set()
        jumped: set[int] = set()
        while stack:
            seq = stack.pop()
            if seq in seen:
                continue
            seen.add(seq)
            unit = self.units[seq]
            t = thresholds.get(unit.lane)
            if t is None:
                t = thresholds[unit.lane] = self._threshold(unit.lane, lane)
            if unit.finished_at < t:
                found.append(unit)
                continue
            if unit.lane in jumped:
                continue
            jumped.add(unit.lane)
            times, seqs = self._by_lane[unit.lane]
            i = bisect.bisect_left(times, t)
            if i > 0:
                stack.append(seqs[i - 1])
            ext_times, ext_seqs = self._external[unit.lane]
            stack.extend(ext_seqs[bisect.bisect_left(ext_times, t):])
        leaves = self._unextended(found)
        if not leaves:
            return self.base, frozenset()
        leaves.sort(key=lambda u: u.seq)
        ends = tuple(dict.fromkeys(e for u in leaves for e in u.ends))
        return ends, frozenset(u.seq for u in leaves)

    def _unextended(self, found: list[_Unit]) -> list[_Unit]:
        """The units of `found` that no other unit of it extends, directly or not: one walk
        down from all of them together (each unit and each distinct parent set once), which a
        unit finished before all of them ends (it extends only earlier ones). A fan-out's
        siblings each extend the same parents: the walk takes that set once, not once per
        sibling and again per unit tested, which made wide fan-outs cubic."""
        if len(found) < 2:
            return found
        floor = min(u.finished_at for u in found)
        reached: set[int] = set()
        walked: set[frozenset[int]] = set()
        stack = [u.extends for u in found]
        while stack:
            extends = stack.pop()
            if extends in walked:
                continue
            walked.add(extends)
            for seq in extends:
                if seq in reached:
                    continue
                reached.add(seq)
                below = self.units[seq]
                if below.finished_at > floor and below.extends:
                    stack.append(below.extends)
        return [u for u in found if u.seq not in reached]

    def finish(self, ends: tuple[str, ...], extends: frozenset[int], lane: _Lane) -> None:
        """Work in `lane` that extended `extends` finished; its result is in `ends`."""
        serial = _serial(lane)
        unit = _Unit(next(self._seq), ends, extends, serial, next(_clock))
        self.units[unit.seq] = unit
        if serial not in self._lineages:
            self._lineages[serial] = _lineage(lane)
            self._by_lane[serial] = ([], [])
            self._external[serial] = ([], [])
        times, seqs = self._by_lane[serial]
        times.append(unit.finished_at)
        seqs.append(unit.seq)
        ext_times, ext_seqs = self._external[serial]
        for seq in extends:
            self._leaves.discard(seq)
            if self.units[seq].lane != serial:
                ext_times.append(unit.finished_at)
                ext_seqs.append(seq)
        self._leaves.add(unit.seq)

    def next_call_id(self) -> str:
        """The id of the next call made directly in this scope."""
        if self.task_id is None:
            return self.run.loose_call_id()
        self._calls += 1
        return self.task_id if self._calls == 1 else f"{self.task_id}.{self._calls}"


@dataclass(frozen=True)
class _Cursor:
    """The context variable's value: the scope, and the asyncio task that set it."""

    scope: _Scope
    lane: _Lane


_cursor: contextvars.ContextVar[_Cursor | None] = contextvars.ContextVar("kvgate_cursor",
                                                                        default=None)
_call_hints: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar(
    "kvgate_call_hints", default={})  # noqa: B039 (never mutated: replaced by `hints`)


def _here() -> tuple[_Scope, _Lane] | None:
    """The current scope and asyncio task, noting where a newly started asyncio task came
    from (its context is a copy of its creator's)."""
    cursor = _cursor.get()
    if cursor is None:
        return None
    lane = _current_lane()
    if lane is not cursor.lane:
        cursor.scope.enter(lane, cursor.lane)
        _cursor.set(_Cursor(cursor.scope, lane))
    return cursor.scope, lane


WORKFLOW_HEADER = "X-KVGate-Workflow"
TASK_HEADER = "X-KVGate-Task"
AFTER_HEADER = "X-KVGate-After"
EXPECT_CHILDREN_HEADER = "X-KVGate-Expect-Children"
PRIORITY_HEADER = "X-KVGate-Priority"
DEADLINE_HEADER = "X-KVGate-Deadline"

# The gateway's ranges for these hints (planner/hints.py) are checked here, where the code
# that sets them is, rather than answered with a 400 on every call made in the block.
MAX_NAME = 200
"""A task name's most characters (its id, NAME-N, goes in headers the gateway caps at 256)."""
LOOSE_CALL = "call"
"""The name of the calls made outside any task (`call-1`, ...), which no task may take."""


def _check_expect_children(value: int | None) -> None:
    if value is not None and (type(value) is not int or not 0 <= value <= MAX_TOKENS):
        raise ValueError(f"expect_children must be an integer from 0 to {MAX_TOKENS}")


def _check_name(name: str | None, what: str) -> None:
    # A task id travels in comma-separated X-KVGate-After lists, ids travel in headers (ASCII),
    # and the gateway strips what it reads from a header.
    if name is not None and (not isinstance(name, str) or not name or name != name.strip()
                             or "," in name or len(name) > MAX_NAME
                             or not name.isascii() or not name.isprintable()):
        raise ValueError(f"a {what} name must be a non-empty printable ASCII string without "
                         f"commas or surrounding spaces, at most {MAX_NAME} characters, got "
                         f"{name!r}")
    if what == "workflow id" and name is not None and names_a_store_key(name):
        raise ValueError(f"the workflow id {name!r} is reserved (it would name a key of the "
                         "gateway's workflow store: index, running, or one ending in :ev or "
                         ":lease; or be resolved away in a URL: . and ..)")
    if what == "task" and name == LOOSE_CALL:
        raise ValueError(f"the task name {LOOSE_CALL!r} is reserved: calls made outside any "
                         f"task are {LOOSE_CALL}-1, {LOOSE_CALL}-2, ...")


@dataclass
class Call:
    """One LLM call made inside a workflow: its gateway task id, parents, and headers."""

    workflow: str
    task: str
    after: tuple[str, ...]
    headers: dict[str, str]
    """The hint headers to send with the request."""
    _scope: _Scope = field(repr=False)
    _extends: frozenset[int] = field(repr=False)
    _lane: _Lane = field(repr=False)

    @property
    def body_hints(self) -> dict[str, Any] | None:
        """What goes in the request body's `kvgate` field besides `headers`: the parents of a
        join too wide for a header (`{"after": [...]}`), else None."""
        if self.after and AFTER_HEADER not in self.headers:
            return {"after": list(self.after)}
        return None

    def finished(self) -> None:
        """The call was answered: later work may extend it."""
        if self._lane is not None and self._scope.open_calls.get(self._lane) is self:
            del self._scope.open_calls[self._lane]
        self._scope.finish((self.task,), self._extends, self._lane)


def call_hints() -> dict[str, str]:
    """The headers of the current `hints` blocks (priority, deadline, expected children): the
    hooks send them with calls made outside any workflow too."""
    return dict(_call_hints.get())


def start_call(retry: bool = False) -> Call | None:
    """A call is being sent from the current context: its hints, or None outside a workflow.
    A retry (`retry=True`) reuses the id of the call this asyncio task has in flight.
    The httpx hooks use it; another HTTP client sends `call.headers` with the request (and
    `call.body_hints`, when not None, as the JSON body's `kvgate` field) and calls
    `call.finished()` once it is answered."""
    here = _here()
    if here is None:
        return None
    scope, lane = here
    if retry and lane is not None and lane in scope.open_calls:
        return scope.open_calls[lane]
    after, extends = scope.parents(lane)
    if len(after) > MAX_AFTER:
        # The gateway takes at most MAX_AFTER parents (a 400 beyond): a join of more names the
        # latest of them; a hint must never break the call it goes with.
        after = after[-MAX_AFTER:]
    call_id = scope.next_call_id()
    headers = {WORKFLOW_HEADER: scope.run.id, TASK_HEADER: call_id}
    if after and len(",".join(after)) <= MAX_AFTER_HEADER:
        headers[AFTER_HEADER] = ",".join(after)
    if scope.expect_children is not None:
        headers[EXPECT_CHILDREN_HEADER] = str(scope.expect_children)
    headers.update(_call_hints.get())
    call = Call(scope.run.id, call_id, after, headers, scope, extends, lane)
    if lane is not None:
        scope.open_calls[lane] = call
    return call


def current_workflow() -> str | None:
    """The id of the workflow the current code runs in, or None."""
    cursor = _cursor.get()
    return cursor.scope.run.id if cursor is not None else None


def current_task() -> str | None:
    """The id of the SDK task the current code runs in, or None (outside any task)."""
    cursor = _cursor.get()
    return cursor.scope.task_id if cursor is not None else None


class hints:
    """Extra hints for the calls made inside the block: `expect_children` (how many later
    calls will extend the call's context; a fan-out the planner can prepare for), `priority`
    (lower first, as vLLM's) and `deadline_s` (seconds from arrival the caller can wait)."""

    def __init__(self, *, expect_children: int | None = None, priority: int | None = None,
                 deadline_s: float | None = None) -> None:
        _check_expect_children(expect_children)
        if priority is not None and (type(priority) is not int
                                     or not -PRIORITY_LIMIT <= priority <= PRIORITY_LIMIT):
            raise ValueError(f"priority must be an integer from -{PRIORITY_LIMIT} to "
                             f"{PRIORITY_LIMIT}")
        if deadline_s is not None and (isinstance(deadline_s, bool) or not
                                       isinstance(deadline_s, int | float)
                                       or not 0 < deadline_s < float("inf")):
            raise ValueError("deadline_s must be a positive, finite number of seconds")
        self._extra: dict[str, str] = {}
        if expect_children is not None:
            self._extra[EXPECT_CHILDREN_HEADER] = str(expect_children)
        if priority is not None:
            self._extra[PRIORITY_HEADER] = str(priority)
        if deadline_s is not None:
            self._extra[DEADLINE_HEADER] = repr(float(deadline_s))
        self._token: contextvars.Token[dict[str, str]] | None = None

    def __enter__(self) -> None:
        self._token = _call_hints.set({**_call_hints.get(), **self._extra})

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _call_hints.reset(self._token)


# -- workflow and task: decorators and async context managers -------------------------------------


@dataclass(frozen=True)
class WorkflowResult(Generic[R_co]):
    """What `await fn.run(...)` returns for a `@workflow` function: the id and the value."""

    id: str
    value: R_co


@dataclass(frozen=True)
class WorkflowInfo:
    """What `async with workflow(...) as wf` gives: the workflow's id and name."""

    id: str
    name: str


class WorkflowFunction(Protocol[P, R_co]):
    """A `@workflow` function: each call runs as a new workflow; `run` also gives its id."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def run(self, *args: P.args,
            **kwargs: P.kwargs) -> Coroutine[Any, Any, WorkflowResult[R_co]]: ...

    # On a method: looked up on an instance it binds the instance, as a function does.
    @overload
    def __get__(self, obj: None, owner: type | None = None) -> WorkflowFunction[P, R_co]: ...

    @overload
    def __get__(self: WorkflowFunction[Concatenate[_T, _P2], R_co], obj: _T,
                owner: type | None = None) -> WorkflowFunction[_P2, R_co]: ...


TaskFunction = Callable[P, Coroutine[Any, Any, R]]
"""A `@task` function: an async function that runs as a new task each time it is called."""


def _check_async(fn: Callable[..., Any], what: str) -> None:
    if not inspect.iscoroutinefunction(fn) and not inspect.iscoroutinefunction(
            inspect.getattr_static(type(fn), "__call__", None)):
        raise TypeError(f"@{what} decorates async functions (or objects with an async "
                        f"__call__); {_fn_name(fn)} is not one")


def _fn_name(fn: Callable[..., Any]) -> str:
    """The name a decorated callable gives its workflow or task: a function's own, a partial's
    function's, else its class's (an object with an async `__call__`)."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(inner, "__name__", None)
    return name if isinstance(name, str) else type(inner).__name__


class _Workflow:
    """What `@workflow` makes of an async function. A descriptor, like a function, so on a
    method both `obj.method(...)` and `obj.method.run(...)` pass `obj` along."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], name: str, fixed: str | None,
                 bound: object = None) -> None:
        functools.update_wrapper(self, fn)
        # What `inspect.iscoroutinefunction` reads (so frameworks that ask, a web framework
        # choosing how to call a handler, see an async function), and `signature` too.
        self.__code__ = getattr(fn, "__code__", None)
        self.__defaults__ = getattr(fn, "__defaults__", None)
        self.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
        self._fn = fn
        self._name = name
        self._fixed = fixed
        self._bound = bound
        if bound is not None:
            params = list(inspect.signature(fn).parameters.values())[1:]
            self.__signature__ = inspect.signature(fn).replace(parameters=params)

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None or self._bound is not None:
            return self
        return _Workflow(self._fn, self._name, self._fixed, obj)

    def _args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return args if self._bound is None else (self._bound, *args)

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        async with WorkflowScope(self._name, self._fixed):
            return await self._fn(*self._args(args), **kwargs)

    async def run(self, *args: Any, **kwargs: Any) -> WorkflowResult[Any]:
        async with WorkflowScope(self._name, self._fixed) as info:
            value = await self._fn(*self._args(args), **kwargs)
        return WorkflowResult(info.id, value)

    def __repr__(self) -> str:
        return f"<kvgate workflow {self._name!r}: {self._fn!r}>"


class WorkflowScope:
    """One workflow run, entered with `async with`; also a decorator (see `workflow`)."""

    def __init__(self, name: str | None, workflow_id: str | None) -> None:
        _check_name(name, "workflow")
        _check_name(workflow_id, "workflow id")
        self.name = name
        self.workflow_id = workflow_id
        self._token: contextvars.Token[_Cursor | None] | None = None
        self._id: str | None = None

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> WorkflowFunction[P, R]:
        """Decorate an async function: each call runs as a new workflow."""
        _check_async(fn, "workflow")
        name = self.name or _fn_name(fn)
        fixed = self.workflow_id

        return cast(WorkflowFunction[P, R], _Workflow(fn, name, fixed))

    async def __aenter__(self) -> WorkflowInfo:
        if self._token is not None:
            raise RuntimeError("a workflow scope is entered once; make a new one per run")
        name = self.name or "workflow"
        wf_id = self.workflow_id or f"{name}-{secrets.token_hex(4)}"
        _install_factory()
        self._id = wf_id
        scope = _Scope(_Run(wf_id), None, ())
        self._token = _cursor.set(_Cursor(scope, _current_lane()))
        return WorkflowInfo(wf_id, name)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._token is not None
        _cursor.reset(self._token)
        if isinstance(exc, Exception) and self._id is not None:
            # The run that failed is worth finding at the gateway (`GET /v1/workflows/ID`).
            exc.add_note(f"in kvgate workflow {self._id}")


class TaskScope:
    """One task of the current workflow, entered with `async with`; also a decorator (see
    `task`)."""

    def __init__(self, name: str | None, expect_children: int | None) -> None:
        _check_expect_children(expect_children)
        _check_name(name, "task")
        self.name = name
        self.expect_children = expect_children
        self._entered: tuple[_Scope, _Scope, _Lane, frozenset[int],
                             contextvars.Token[_Cursor | None]] | None = None
        self._used = False

    def __call__(self, fn: Callable[P, Awaitable[R]]) -> TaskFunction[P, R]:
        """Decorate an async function: each call runs as a new task."""
        _check_async(fn, "task")
        name = self.name or _fn_name(fn)
        _check_name(name, "task")
        expect = self.expect_children

        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            async with TaskScope(name, expect):
                return await fn(*args, **kwargs)

        if not isinstance(getattr(fn, "__name__", None), str):
            # A partial or a callable object: named as its task is (`@workflow` over it too).
            call.__name__ = call.__qualname__ = _fn_name(fn)
        return call

    async def __aenter__(self) -> str | None:
        if self._used:
            raise RuntimeError("a task scope is entered once; make a new one per task")
        self._used = True
        here = _here()
        if here is None:
            return None
        scope, lane = here
        after, extends = scope.parents(lane)
        task_id = scope.run.task_id(self.name or "task")
        inner = _Scope(scope.run, task_id, after, self.expect_children)
        token = _cursor.set(_Cursor(inner, lane))
        self._entered = (scope, inner, lane, extends, token)
        return task_id

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._entered is None:
            return
        outer, inner, lane, extends, token = self._entered
        self._entered = None
        _cursor.reset(token)
        if exc_type is None:
            ends, _ = inner.parents(lane)
            outer.finish(ends, extends, lane)


@overload
def workflow(name: Callable[P, Awaitable[R]], /) -> WorkflowFunction[P, R]: ...


@overload
def workflow(name: str | None = None, *, id: str | None = None) -> WorkflowScope: ...


def workflow(name: Any = None, *, id: str | None = None) -> Any:
    """Run code as one workflow: `@workflow` or `@workflow("name")` over an async function, or
    `async with workflow("name") as wf:`. The id is NAME-<8 random hex digits> (the function's
    name by default) unless `id` is given; every call made inside carries it.
    `await fn.run(...)` returns the id with the function's value."""
    if callable(name):
        return WorkflowScope(None, None)(name)
    return WorkflowScope(name, id)


@overload
def task(name: Callable[P, Awaitable[R]], /) -> TaskFunction[P, R]: ...


@overload
def task(name: str | None = None, *, expect_children: int | None = None) -> TaskScope: ...


def task(name: Any = None, *, expect_children: int | None = None) -> Any:
    """Run code as one task of the current workflow: `@task` or `@task("name")` over an async
    function, or `async with task("name") as task_id:`. Its id is NAME-N (the N-th task of that
    name in the workflow). Outside a workflow it changes nothing. `expect_children` is sent
    with each of the task's calls (`X-KVGate-Expect-Children`: how many later calls will
    extend its context)."""
    if callable(name):
        return TaskScope(None, None)(name)
    return TaskScope(name, expect_children)
