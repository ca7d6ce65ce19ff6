"""The Doctor on an unedited plain loop: its objects found as they are made, its steps read from its calls.

What a user hands `Doctor(model, optimizer, loader)` and marks with `doctor.step(batch)` is found here:
- the model: DistributedDataParallel's (and FSDP's) constructor is wrapped, so each one built in this
  process is known as it is built (before any `torch.compile` wraps it: the Doctor is given the DDP module);
- the optimizer: `Optimizer.__init__` is wrapped too, so at a built model's first training forward the newest
  optimizer holding its parameters is known, and the Doctor attaches there: the first step is timed, and the
  steps are counted as the script counts them. An optimizer made after that forward is found instead at its
  first step, through torch's global optimizer step hook (`register_optimizer_step_post_hook`, called after
  every optimizer's step), which then attaches the Doctor (that first step is not timed);
- a step is an optimizer step: it begins at the model's first training forward after the previous step
  (gradient accumulation: several forwards, one step) and ends when that optimizer's step returns;
  the time between is the loop's own (data loading and anything else), as `doctor.step(batch)` times it;
- the batch (DOC001) and the loss (DOC018) off the model's forward (callback/model_tap.py): a loss the
  script computes outside the model is not seen, and said once at the end (DOC020);
- the loader (DOC002, DOC003): the DataLoader most recently iterated when the Doctor attaches.
Per step this costs a Python call before the forward and one after the optimizer's step, as a hand-placed
`doctor.step()` does, and one after the forward for the loss while the model returns one (removed after
LOSS_LOOK_STEPS steps without: a plain loop computes its loss outside the model). Once attached, the hooks
that looked for the Doctor (on every built model, and torch's global optimizer hook, called at every
optimizer's step) give way to two lean ones on the watched model and its optimizer (`_BeginStep`,
`_EndStep`): no weak reference to follow, no lookup, nothing called at another optimizer's step; they come
back when that Doctor closes (a second fit attaches its own). A framework's Trainer (attach/frameworks.py)
runs its adapter instead: then nothing here attaches.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Optional

from ddpdoctor.attach.settings import RunSettings
from ddpdoctor.callback.model_tap import ModelTap, unseen_loss
from ddpdoctor.callback.weak_hooks import WeakHook

log = logging.getLogger("ddpdoctor")

MakeDoctor = Callable[..., Any]
# Steps whose forwards are looked at for a loss (a model that returns one); none by then: the hook is removed.
LOSS_LOOK_STEPS = 16


class Attacher:
    """One process's attachment: the models built, the loader iterated last, and the Doctor once attached."""

    def __init__(self, settings: RunSettings, make_doctor: MakeDoctor) -> None:
        self.settings = settings
        self.make_doctor = make_doctor
        self.models: list[weakref.ref] = []  # DDP/FSDP modules built here, oldest first
        self.loader: Optional[weakref.ref] = None  # the DataLoader iterated last
        self.doctor: Any = None
        self.model: Optional[weakref.ref] = None  # the one the Doctor watches
        self.tap: Optional[ModelTap] = None
        self.framework: Optional[str] = None  # a Trainer's adapter runs the Doctor in this process
        self.gave_up = False  # attaching failed once: not tried again at every step
        self._not_ours: set[int] = set()  # optimizers already seen to step no built model's parameters
        self.optimizers: list[weakref.ref] = []  # optimizers built here, oldest first
        self._tried: set[int] = set()  # models whose first training forward looked for their optimizer
        self._looking: dict[int, Any] = {}  # a built model's id: its hook looking for the Doctor's first step
        self._global_hook: Any = None  # torch's global optimizer step hook, while no Doctor is attached
        self._step_hooks: list[Any] = []  # the attached Doctor's two (_BeginStep, _EndStep)
        self._pre_forward: Any = None  # DDP's _pre_forward as wrapped here (None: not wrapped)

    # -- installed when torch is imported ---------------------------------------------------
    def on_torch(self, torch: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook
        from torch.utils.data import DataLoader

        self.wrap_init(DistributedDataParallel)
        self._pre_forward = _wrap_pre_forward(DistributedDataParallel)
        self.wrap_init(Optimizer, self.optimizer_built)
        _wrap_iter(DataLoader, self)
        self._global_hook = register_optimizer_step_post_hook(self._after_optimizer_step)

    def on_fsdp(self, module: Any) -> None:
        self.wrap_init(module.FullyShardedDataParallel)

    def wrap_init(self, cls: type, then: Optional[Callable[[Any], None]] = None) -> None:
        """`cls.__init__` followed by `then(instance)` (default: `built`), once (also the Trainers': frameworks.py)."""
        original = getattr(cls, "__init__")
        if getattr(original, "__ddpdoctor_wrapped__", False):
            return
        after = then if then is not None else self.built

        @functools.wraps(original)
        def init(*args: Any, **kwargs: Any) -> None:  # no named `self`: DDP takes `module=` by keyword
            original(*args, **kwargs)
            after(args[0])

        init.__ddpdoctor_wrapped__ = True  # type: ignore[attr-defined]
        setattr(cls, "__init__", init)

    # -- the script's calls --------------------------------------------------------------
    def built(self, module: Any) -> None:
        """A DDP (or FSDP) module was built: known, and its forward begins the steps once a Doctor runs. The
        hook goes first (prepend), so the batch and loss hooks that come with the Doctor see the step open."""
        if any(ref() is module for ref in self.models):
            return  # FSDP's nested units call the constructor again for their own modules
        self.models.append(weakref.ref(module))
        self._looking[id(module)] = module.register_forward_pre_hook(WeakHook(self, "_before_forward"),
                                                                     prepend=True, with_kwargs=True)

    def iterated(self, loader: Any) -> None:
        self.loader = weakref.ref(loader)

    def optimizer_built(self, optimizer: Any) -> None:
        self.optimizers.append(weakref.ref(optimizer))

    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        """A built model's first training forward attaches the Doctor, where an optimizer holding its parameters
        exists, and begins its first step, with its inputs as the step's batch (`_BeginStep` begins the next)."""
        if self.doctor is not None or not module.training or id(module) in self._tried:
            return
        self._tried.add(id(module))
        optimizer = self._optimizer_of(module)
        if optimizer is not None and self.framework is None and not self.gave_up:
            self._attach(optimizer, model=module)
            if self.doctor is not None:
                self.doctor.step_begin(kwargs if kwargs else args)

    def _after_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Any optimizer's step while no Doctor is attached: one made after its model's first forward attaches it."""
        if (self.doctor is None and self.framework is None and not self.gave_up
                and id(optimizer) not in self._not_ours):
            self._attach(optimizer)

    # -- attaching -----------------------------------------------------------------------
    def _attach(self, optimizer: Any, model: Any = None) -> None:
        import torch.distributed as dist

        model = model if model is not None else self._model_of(optimizer)
        if model is not None and not (dist.is_available() and dist.is_initialized()):
            model = None  # after the job's end (its process group destroyed): nothing of the job's to watch
        if model is None:
            self._not_ours.add(id(optimizer))
            return
        loader = self.loader() if self.loader is not None else None
        try:
            self.doctor = self.make_doctor(model, optimizer=optimizer, loader=loader, **self.settings.options)
        except Exception as exc:  # the script runs on unwatched: one line says why
            self.gave_up = True
            log.warning("ddpdoctor run: could not attach the Doctor: %s: %s", type(exc).__name__, exc)
            return
        self.model = weakref.ref(model)
        self.tap = ModelTap(model, self.doctor, batch=False)  # the batch comes with the step's begin (_BeginStep)
        self.doctor.before_close(self._before_close)
        # The lean hooks take over: the model's looking hook and the global optimizer hook are removed.
        looking = self._looking.pop(id(model), None)
        if looking is not None:
            looking.remove()
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None
        self._step_hooks = [self._begin_hook(model),
                            optimizer.register_step_post_hook(_EndStep(self.doctor, self.tap))]
        self.settings.mark_attached(f"{type(model).__name__} on rank {self.doctor.rank}")

    def _begin_hook(self, model: Any) -> Any:
        """The step's begin on the watched model, and its handle. A DDP model's is called from DDP's own
        `_pre_forward` (wrapped once, at the class): a forward pre-hook would take every forward off
        `Module.__call__`'s fast path, which is most of what a hook costs (about 2 µs a forward by timeit,
        against 0.3 µs for the call itself). FSDP's, or where that method is not found, is a forward pre-hook."""
        from torch.nn.parallel import DistributedDataParallel

        begin = _BeginStep(self.doctor)
        if self._pre_forward is not None and isinstance(model, DistributedDataParallel):
            _skipped_by_dynamo(self._pre_forward.__code__)  # DDP's constructor has imported torch._dynamo
            _BEGINS[id(model)] = begin
            return _Entry(id(model))
        return model.register_forward_pre_hook(begin, prepend=True, with_kwargs=True)

    def _optimizer_of(self, model: Any) -> Any:
        """The newest optimizer built here that holds this model's parameters, or None (made later)."""
        return _newest(self.optimizers, lambda optimizer: _shares_parameters(model, optimizer))

    def _model_of(self, optimizer: Any) -> Any:
        """The newest built model whose parameters this optimizer steps (a GAN's two: each its own)."""
        return _newest(self.models, lambda model: _shares_parameters(model, optimizer))

    def _before_close(self) -> None:
        """What could not be seen without code, said once (the loss, where the model's forward returned none);
        then this Doctor is let go: a model built later (a second fit) attaches a Doctor of its own."""
        tap, doctor, model = self.tap, self.doctor, self.model() if self.model is not None else None
        if tap is not None:
            if not tap.loss_seen and doctor.steps_done:
                doctor.tell([unseen_loss(doctor.world_size, doctor.steps_done, seen_from="ddpdoctor run")])
            tap.close()
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []
        if self._global_hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._global_hook = register_optimizer_step_post_hook(self._after_optimizer_step)
        self.models = [ref for ref in self.models if ref() is not None and ref() is not model]
        self.tap = self.doctor = self.model = None
        self._not_ours.clear()

    def close(self) -> None:
        """The end of the script: the Doctor's own close (the final check, the summary), if it still runs."""
        self.gave_up = True  # nothing attaches after the script's end (an atexit step of someone else's)
        if self.doctor is not None:
            self.doctor.close()


class _StepHook:
    """A hook of the attached Doctor's, held strongly (no weak reference to follow each step: these two are
    the whole per-step cost) but copied and pickled as one that does nothing, as WeakHook is
    (callback/weak_hooks.py): an EMA's `deepcopy(model)` or a pickled optimizer drags nothing of ours along."""

    __slots__ = ("doctor", "tap")

    def __init__(self, doctor: Any = None, tap: Optional[ModelTap] = None) -> None:
        self.doctor, self.tap = doctor, tap

    def __deepcopy__(self, memo: dict) -> _StepHook:
        return type(self)()

    def __reduce__(self) -> tuple:
        return (type(self), ())


class _BeginStep(_StepHook):
    """The watched model's forward pre-hook: its first training forward since the last step begins one, with
    its inputs as the step's batch (gradient accumulation's next micro-batch is inside the same step)."""

    __slots__ = ()

    def __call__(self, module: Any, args: Any, kwargs: Any) -> None:
        doctor = self.doctor
        if doctor is not None and module.training and not doctor.in_step:
            try:
                doctor.step_begin(kwargs if kwargs else args)
            except Exception:  # never into the user's forward
                log.debug("ddpdoctor run: a step's begin failed", exc_info=True)


class _EndStep(_StepHook):
    """The watched optimizer's step post hook: the step ends, with the loss the model's forward returned.
    A finding raised at its check (raise_on_finding) reaches the loop, as the explicit `doctor.step()` does."""

    __slots__ = ()

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        doctor, tap = self.doctor, self.tap
        if doctor is None:
            return
        # No test of in_step here: step_end itself returns at once outside a step (a second optimizer.step()).
        if tap is None:  # no loss to take (none seen in the first steps): the step's end alone
            doctor.step_end()
            return
        doctor.step_end(tap.take_loss())
        if not tap.loss_seen and doctor.steps_done == LOSS_LOOK_STEPS:
            tap.stop_watching_loss()  # the loss is computed outside the model: a hook less a forward,
            self.tap = None  # and three calls less a step here


# A watched DDP model's id: its _BeginStep, called from DDP's own _pre_forward (_wrap_pre_forward). One table
# for the process, as the wrapper is one for the class.
_BEGINS: dict[int, _BeginStep] = {}


class _Entry:
    """A handle to a `_BEGINS` entry, removed as a hook's handle is."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key

    def remove(self) -> None:
        _BEGINS.pop(self.key, None)


def _wrap_pre_forward(cls: type) -> Any:
    """`cls._pre_forward` (DDP's, called first thing in its forward with the forward's inputs) preceded by the
    watched model's `_BeginStep`, looked up by the model's id: a dictionary miss (about 40 ns) for any other
    DDP model, nothing on the instance (a deepcopy or pickle of the model sees no trace of us). The wrapper,
    or None where the method is not there (another torch): then a forward pre-hook begins the step."""
    original = getattr(cls, "_pre_forward", None)
    if original is None or getattr(original, "__ddpdoctor_wrapped__", False):
        return original
    lookup = _BEGINS.get

    @functools.wraps(original)
    def _pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        begin = lookup(id(self))
        if begin is not None:
            begin(self, inputs, kwargs)
        return original(self, *inputs, **kwargs)

    _pre_forward.__ddpdoctor_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, "_pre_forward", _pre_forward)
    return _pre_forward


def _skipped_by_dynamo(code: Any) -> None:
    """torch.compile runs this code, and what it calls, as it is, never tracing it (where this torch says how):
    under a compiled DDP model the begin is called from DDP's forward, which dynamo does not trace, and a frame
    of ours must not be compiled on its own either. Imports torch._dynamo: called once DDP's constructor has."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except Exception:  # another torch: its default (a frame with no tensor work is not compiled)
        log.debug("ddpdoctor run: could not mark the step hook as not traced", exc_info=True)


def _newest(refs: list[weakref.ref], fits: Callable[[Any], bool]) -> Any:
    """The newest of the objects still alive that `fits`, or None."""
    for ref in reversed(refs):
        obj = ref()
        if obj is not None and fits(obj):
            return obj
    return None


def _shares_parameters(model: Any, optimizer: Any) -> bool:
    """The optimizer steps at least one of the model's parameters."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return any(id(p) in stepped for p in model.parameters())


def _wrap_iter(cls: type, attacher: Attacher) -> None:
    original = cls.__iter__  # type: ignore[attr-defined]
    if getattr(original, "__ddpdoctor_wrapped__", False):
        return
    ref = weakref.ref(attacher)

    @functools.wraps(original)
    def iterate(loader: Any) -> Any:
        target = ref()
        if target is not None:
            target.iterated(loader)
        return original(loader)

    iterate.__ddpdoctor_wrapped__ = True  # type: ignore[attr-defined]
    cls.__iter__ = iterate  # type: ignore[attr-defined]
