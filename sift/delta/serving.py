"""Serving many sparse fine-tunes over one base model in one batch: each row of a batch names
the delta it runs with (or None for the base), and every row gets its own fine-tune's outputs.

`ServedDeltas(model)` hooks the base model's linear layers (nn.Linear, and transformers' Conv1D
of GPT-2) with forward hooks, so the weights, the module tree and the state dict stay as they
are, and keeps, per layer, the loaded deltas in one `DeltaBank` (CSR per delta). A layer's
output `y = x W^T + b` is computed by the base layer as usual; the hook then adds, for each
token of row r, the product of its input with row r's delta (`sift._ops.mixed_delta_matmul_`,
C++ on CPU, Triton on CUDA). Rows served by the base are left as the base layer wrote them, bit
for bit.

    served = ServedDeltas(model)
    served.load_delta("math", "runs/math")           # a fine-tune directory, or a SparseDelta
    served.load_delta("chat", chat_delta)
    with served.rows(["math", None, "chat"]):        # one name (or None) per row of the batch
        logits = model(input_ids).logits
    out = served.generate(input_ids, delta_names=["math", None, "chat"], max_new_tokens=20)

What a row gets: the weights `SparseDelta.apply_` would give its delta. At load, each entry of a
16-bit weight becomes the increment the apply really makes in the weight's dtype,
`fp32(dtype(w + v)) - fp32(w)` (a bf16 weight keeps only what bf16 can hold of w + v); an fp32
weight's entries keep v (w + v rounds once, as in the apply). The outputs then differ from the
fine-tune applied in place only by how the product is rounded: `dtype(dtype(x W^T) + x D^T)`, the
base product rounded before the delta's term is added (fp32, a few units of fp32 rounding;
bf16/fp16, about one more rounding of the output per layer). A layer's bank holds a 16-bit weight's
increments in the weight's dtype when each of them is exact there (a step of at most half the
weight always is), else in fp32. On the CPU a bank is packed (`PackedDeltaBank`: each position's low
byte, the rest as Elias-Fano's unary buckets, an entry offset per 32 rows): about 3.2 bytes an entry
with 16-bit values and 5.2 with fp32 ones at 1% density (`held_bytes`), no more than the fine-tune's
file. On CUDA (and for the Triton backend) it stays CSR (`DeltaBank`: int16 columns, int32 row
pointers), about 2 bytes an entry more.

Over a bitsandbytes 4-bit or 8-bit base, a quantized layer's delta stays its fp32 entries `v` and
its rows gain `x S^T` on top of the layer's own output, as a fine-tune attached to that layer
(`apply_`, `sift.quantized`) computes `x (dequant(Wq) + S)^T`. An 8-bit layer's rows with a delta
recompute their base product with the dequantized weight, as the attached fine-tune does
(bitsandbytes' own int8 product also quantizes the activations); rows on the base keep its bits.
`switch_to` is refused there: a packed weight cannot take the entries.

Deltas are checked against the model as `apply_` checks them (names, shapes, dtypes, the base
fingerprint) and refused, with every problem listed and nothing changed, when they do not fit.
A dense part that replaces an nn.Linear's weight or bias (a classifier head trained densely) is
served per row: that delta's rows are computed with the replaced weight and bias. What cannot
differ per row is refused, never dropped: any other dense part (a norm, an embedding) and a
sparse entry outside a linear layer's weight (an embedding, a norm, a bias). Serving is inference: gradients do not flow through the deltas.
The base must not change while deltas are loaded (their increments were taken against it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sift import _ops
from sift._ops import DeltaBank, PackedDeltaBank
from sift._ops.registry import forced_backend
from sift.delta.application import _APPLIED, _base_problems
from sift.delta.entry import DeltaError
from sift.delta.fingerprint import _state_of, logical_state
from sift.delta.sparse_delta import SparseDelta
from sift.quantized import _dequantize, is_linear8bit, is_quantized_linear


@dataclass
class _Rows:
    """The rows of the batch being served: one delta number (or -1) per row, per device."""

    names: list[str | None]
    ids: torch.Tensor  # [rows] int32 on the CPU
    expand: int = 1  # each row stands for this many consecutive rows of the batch (beams, samples)
    on_device: dict[tuple[torch.device, int], torch.Tensor] = field(default_factory=dict)

    def token_ids(self, device: torch.device, batch: int, tokens: int) -> torch.Tensor:
        """`[batch * tokens]` int32: every token of row r carries row r's delta number."""
        if batch != len(self.names) * self.expand:
            raise RuntimeError(f"the batch has {batch} rows, but {len(self.names)} delta names were given"
                               + (f" (each for {self.expand} rows)" if self.expand > 1 else "")
                               + "; pass one name (or None) per row")
        key = (device, tokens)
        ids = self.on_device.get(key)
        if ids is None:
            ids = self.ids.to(device).repeat_interleave(self.expand * tokens)
            self.on_device[key] = ids
        return ids


class _ServedLayer:
    """One linear layer's (nn.Linear or transformers' Conv1D) loaded deltas (its `DeltaBank`, one
    delta per loaded name in load order, and the dense parts that replace its weight or bias for
    some deltas) and the forward hook that gives the served rows their deltas' outputs."""

    def __init__(self, served: ServedDeltas, module: nn.Module, bank: DeltaBank | PackedDeltaBank):
        self.served = served
        self.module = module
        self.bank = bank  # sets `entries` too
        # delta name -> (weight, bias) its rows are computed with: a head trained densely (None: the layer's)
        self.heads: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.int8 = is_linear8bit(module)
        self.conv1d = _is_conv1d(module)
        # The base values the entries of the delta `switch_to` put in place overwrote (None: none in place).
        self.saved: torch.Tensor | None = None
        self.handle = module.register_forward_hook(self._hook)

    @property
    def bank(self) -> DeltaBank | PackedDeltaBank:
        return self._bank

    @bank.setter
    def bank(self, bank: DeltaBank | PackedDeltaBank) -> None:
        # A 16-bit weight's increments are held in its dtype when every one of them is exact there (they
        # are when no step exceeds half its weight), else in fp32; an fp32 weight's stay fp32.
        dtype = self.module.weight.dtype
        if dtype in (torch.bfloat16, torch.float16) and not is_quantized_linear(self.module):
            bank = bank.narrowed(dtype)
        if isinstance(bank, DeltaBank) and self.served._packs(bank.device):
            bank = bank.packed()
        self._bank = bank
        # Each delta's entry count, on the host: switch_to sizes its buffers without reading the device.
        self.entries = bank.entry_counts()

    def weight_rows(self) -> torch.Tensor:
        """The weight as `[out_features, in_features]`, the bank's rows and columns: the parameter itself,
        or its transposed view for Conv1D (written under no_grad, so no detached alias is needed)."""
        w = self.module.weight
        return w.t() if self.conv1d else w

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        rows = self.served._rows
        if rows is None or (self.bank.max_row_entries == 0 and not self.heads):
            return
        x = args[0]
        n_cols = self.bank.in_features
        batch = x.shape[0]
        tokens = x.numel() // max(batch * n_cols, 1)
        ids = rows.token_ids(output.device, batch, tokens)
        if x.dtype != output.dtype:  # autocast: the layer computed in another dtype
            x = x.to(output.dtype)
        y2, x2 = output.view(-1, output.shape[-1]), x.reshape(-1, n_cols)
        with torch.no_grad():
            if self.int8:
                # bitsandbytes' int8 product quantizes the activations; a fine-tune attached to the layer
                # multiplies by the dequantized weight (sift.quantized), so its rows are recomputed that way.
                served = ids >= 0
                bias = module.bias.to(output.dtype) if module.bias is not None else None
                y2[served] = nn.functional.linear(x2[served], _dequantize(module, output.dtype), bias)
            for name, (weight, bias) in self.heads.items():
                if name not in rows.names:
                    continue
                mine = ids == self.served._names.index(name)
                weight = module.weight if weight is None else weight
                bias = module.bias if bias is None else bias
                y2[mine] = nn.functional.linear(x2[mine], weight.to(output.dtype),
                                                None if bias is None else bias.to(output.dtype))
            if self.bank.max_row_entries == 0:
                return
            _ops.mixed_delta_matmul_(output, x, ids, self.bank, check_values=False, backend=self.served.backend)
        return


class _SwitchPlan:
    """What every `switch_to` hands the op, gathered once per set of loaded deltas (a load or an unload
    makes a new one): the layers in order, their banks, the first bitsandbytes layer (which refuses the
    switch), and the layers grouped by weight dtype and device, so that the base values a delta's
    entries overwrite are saved in one allocation split into the layers' parts."""

    def __init__(self, layers: dict[str, _ServedLayer]):
        self.layers = list(layers.values())
        self.banks = [layer.bank for layer in self.layers]
        self.headed = [layer for layer in self.layers if layer.heads]  # layers with a dense head to put in
        self.packed = next((owner for owner, layer in layers.items() if is_quantized_linear(layer.module)), None)
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault((layer.module.weight.dtype, layer.bank.device), []).append(i)
        self.groups = list(groups.items())

    def weights(self) -> list[torch.Tensor]:
        # Taken at each switch, not kept: the weights are the modules' tensors of the moment.
        return [layer.weight_rows() for layer in self.layers]

    def buffers(self, delta: int) -> list[torch.Tensor]:
        """Per layer, an uninitialised `[k]` tensor in the weight's dtype, k the delta's entries in the layer."""
        out: list[torch.Tensor] = [None] * len(self.layers)  # type: ignore[list-item]
        for (dtype, device), members in self.groups:
            sizes = [self.layers[i].entries[delta] for i in members]
            for i, part in zip(members, torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes)):
                out[i] = part
        return out


def _no_entries() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0)


class ServedDeltas:
    """Serve many sparse fine-tunes of one base model in one batch, one delta (or none) per row.

    peft's habits: `load_delta(name, ...)`, `unload_delta(name)`, `list_deltas()`, and the
    rows' delta names per call (`rows(...)` as a context, or `delta_names=` of `forward` and
    `generate`). See the module docstring for what a row gets and what is refused.

    Args:
        model: the base model; its linear layers are hooked as deltas touching them are loaded.
        backend: force the op's backend ("torch", "cpp", "triton"; default: the automatic choice).
        layout: how each layer's deltas are held: "packed" (`PackedDeltaBank`, CPU only, with the "torch"
            or "cpp" backend: about 1.5 bytes an entry fewer, no more than the fine-tune's file at 1%;
            its product decodes the positions, slower than CSR's: docs/serving.md), "csr"
            (`DeltaBank`, any device and backend), or "auto" (packed on the CPU unless the Triton
            backend serves, else CSR). Both give the same bits.

    Example:
        >>> base = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> tuned = torch.nn.Sequential(torch.nn.Linear(4, 3))
        >>> tuned.load_state_dict(base.state_dict())
        <All keys matched successfully>
        >>> with torch.no_grad():
        ...     tuned[0].weight[1, 2] += 1.0
        >>> served = ServedDeltas(base)
        >>> served.load_delta("tuned", SparseDelta.from_diff(base, tuned, density=1.0))
        >>> x = torch.randn(2, 4)
        >>> y = served(x, delta_names=["tuned", None])
        >>> torch.allclose(y[0], tuned(x)[0]) and torch.equal(y[1], base(x)[1])
        True
        >>> served.close()
    """

    def __init__(self, model: nn.Module, *, backend: str | None = None, layout: str = "auto"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if layout not in ("auto", "packed", "csr"):
            raise ValueError(f"layout must be 'auto', 'packed' or 'csr', got {layout!r}")
        if layout == "packed" and (backend or forced_backend()) == "triton":
            raise ValueError("layout='packed' is a CPU form the Triton backend does not read; use layout='csr' or "
                             "'auto' with backend='triton'")
        self.model = model
        self.backend = backend
        self.layout = layout
        self._names: list[str] = []
        self._layers: dict[str, _ServedLayer] = {}
        self._rows: _Rows | None = None
        self._in_place: str | None = None  # the delta applied to the weights by `switch_to`
        self._plan: _SwitchPlan | None = None  # switch_to's view of the layers; None after a load or unload
        self._dense_saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, base copy) its heads replaced

    def _packs(self, device: torch.device) -> bool:
        """Whether banks on `device` are held packed (`layout`; "auto": on the CPU unless Triton serves)."""
        if self.layout == "csr":
            return False
        if self.layout == "packed":
            return True
        return device.type == "cpu" and (self.backend or forced_backend()) != "triton"

    # -- loading --------------------------------------------------------------------------

    def list_deltas(self) -> list[str]:
        """The loaded deltas' names, in load order."""
        return list(self._names)

    def load_delta(self, name: str, delta: SparseDelta | str | os.PathLike, *, check_base: bool = True) -> None:
        """Load a fine-tune under `name`: a `SparseDelta` or its directory (`SparseDelta.save_pretrained`).

        Everything is checked first; on any problem a `DeltaError` lists them all and nothing
        changes (no layer hooked, no delta added).

        Args:
            name: the name rows refer to it by (a new one).
            delta: the delta, or the fine-tune directory to read it from.
            check_base: compare the model with the delta's base fingerprint (as `apply_` does).

        Raises:
            DeltaError: the delta does not fit the model, has a dense part other than an nn.Linear's
                weight or bias, or touches a weight that is not a linear layer's; or `name` is taken.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if self._rows is not None:
            raise RuntimeError("cannot load a delta while rows are being served (inside `rows(...)`)")
        self._refuse_in_place("load a delta")
        if not isinstance(delta, SparseDelta):
            delta = SparseDelta.from_pretrained(delta)
        state = _state_of(self.model, "model")
        problems = [] if name not in self._names else [f"a delta named {name!r} is already loaded (unload it first)"]
        problems += delta.problems()
        modules = dict(self.model.named_modules())
        heads = _heads(delta, modules, state, problems)
        targets: dict[str, tuple[nn.Module, str]] = {}  # module name -> (module, its weight's name)
        for param, e in delta.entries.items():
            if param in delta.dense:  # replaced whole (as apply_ puts the dense part over the entries)
                continue
            p = state.get(param)
            if p is None:
                problems.append(f"{param}: no such weight in the model")
                continue
            owner, _, leaf = param.rpartition(".")
            module = modules.get(owner)
            if leaf == "weight" and is_quantized_linear(module):  # packed bytes: the layer's [out, in] counts
                if e.shape != (module.out_features, module.in_features):
                    problems.append(f"{param}: delta {e.shape}, quantized layer {(module.out_features, module.in_features)}")
                elif e.nnz:
                    targets[owner] = (module, param)
                continue
            if tuple(p.shape) != e.shape or p.dtype != e.dtype:
                problems.append(f"{param}: delta {e.dtype} {e.shape}, model {p.dtype} {tuple(p.shape)}")
                continue
            if leaf != "weight" or not _is_linear(module) or module.weight is not _param_of(self.model, param):
                what = type(module).__name__ if module is not None else "no module"
                problems.append(f"{param}: only linear layers' weights can be served per row ({what}.{leaf}); "
                                "apply this fine-tune in place (SparseDelta.apply_) instead")
                continue
            if e.nnz:
                targets[owner] = (module, param)
        if self.layout == "packed":
            problems += [f"{param}: layout='packed' holds CPU banks, this weight is on {module.weight.device} "
                         "(use layout='csr' or 'auto')" for module, param in targets.values()
                         if module.weight.device.type != "cpu"]
        if check_base and delta.base is not None:
            problems += _base_problems(delta.base, logical_state(self.model), _APPLIED.get(self.model, []))
        if problems:
            raise DeltaError(f"cannot load the sparse delta {name!r}; nothing changed", problems)
        # Every check passed: build the new banks, then install them all at once.
        new_banks: dict[str, DeltaBank | PackedDeltaBank] = {}
        for owner, (module, param) in targets.items():
            e = delta.entries[param]
            layer = self._layers.get(owner)
            bank = layer.bank if layer is not None else None
            new_banks[owner] = _increments(module, e.indices, e.values, bank,
                                           len(self._names))
        for owner, layer in self._layers.items():
            if owner not in new_banks:
                new_banks[owner] = layer.bank.appended(*_no_entries())
        for owner in heads:
            if owner not in new_banks:  # a head-only layer: no delta has entries in it
                module = modules[owner]
                new_banks[owner] = DeltaBank.from_rows_and_cols((module.out_features, module.in_features),
                                                                [_no_entries()] * (len(self._names) + 1),
                                                                device=module.weight.device)
        for owner, bank in new_banks.items():
            if owner in self._layers:
                self._layers[owner].bank = bank
            else:
                self._layers[owner] = _ServedLayer(self, modules[owner], bank)
        for owner, (weight, bias) in heads.items():
            self._layers[owner].heads[name] = (weight, bias)
        self._names.append(name)
        self._plan = None

    def held_bytes(self, name: str) -> int:
        """Bytes the loaded delta `name` holds: in every layer's bank its entries (a value in the bank's
        dtype: the weight's 16-bit dtype where every increment is exact there, else fp32; a packed
        position on the CPU, an int16 or int32 column and int32 row pointers in CSR) and its dense heads.

        Raises:
            KeyError: no delta of that name is loaded.
        """
        if name not in self._names:
            raise KeyError(f"no delta named {name!r} is loaded (loaded: {self._names})")
        number, held = self._names.index(name), 0
        for layer in self._layers.values():
            held += layer.bank.delta_bytes(number)
            held += sum(t.numel() * t.element_size() for t in layer.heads.get(name, ()) if t is not None)
        return held

    def unload_delta(self, name: str) -> None:
        """Take the delta `name` out (its entries leave every layer; layers no delta touches are unhooked).

        Raises:
            KeyError: no delta of that name is loaded (nothing changes).
        """
        if name not in self._names:
            raise KeyError(f"no delta named {name!r} is loaded (loaded: {self._names})")
        if self._rows is not None:
            raise RuntimeError("cannot unload a delta while rows are being served (inside `rows(...)`)")
        if self._in_place == name:
            raise RuntimeError(f"cannot unload {name!r}: it is applied in place (switch_to(None) first)")
        number = self._names.index(name)
        for owner in list(self._layers):
            layer = self._layers[owner]
            layer.bank = layer.bank.without(number)
            layer.heads.pop(name, None)
            if layer.bank.values.numel() == 0 and not layer.heads:
                layer.handle.remove()
                del self._layers[owner]
        self._names.pop(number)
        self._plan = None

    def close(self) -> None:
        """Unload every delta and remove every hook: the model is the plain base again."""
        self.switch_to(None)
        for layer in self._layers.values():
            layer.handle.remove()
        self._layers.clear()
        self._names.clear()
        self._rows = None
        self._plan = None

    # -- one delta for the whole model, in place ----------------------------------------------

    def switch_to(self, name: str | None) -> None:
        """Put the loaded delta `name` into the weights in place (None: back to the base), replacing
        the one put there before: its entries get their saved base values back, then this one's
        are added, in one C++ call for the whole model (`delta_bank_switch_`), O(entries of both).

        A batch served by one fine-tune then runs at the base model's speed, with no hook work, and
        the weights are those `apply_` gives, bit for bit (the switch is not an `apply_`: the model's
        own `remove_` and `disabled` do not see it). While a delta is in place, `rows(...)`,
        `load_delta` and unloading it are refused (the served increments are taken against the base).

        Raises:
            KeyError: `name` is not loaded (nothing changes).
            RuntimeError: inside `rows(...)`, or a loaded delta touches a bitsandbytes layer, whose packed
                weight cannot take entries (nothing changes).

        Example:
            >>> base = torch.nn.Linear(4, 3, bias=False)
            >>> tuned = torch.nn.Linear(4, 3, bias=False)
            >>> served = ServedDeltas(base)
            >>> served.load_delta("t", SparseDelta.from_diff(base, tuned, density=1.0))
            >>> served.switch_to("t")
            >>> torch.equal(base.weight, tuned.weight)
            True
            >>> served.switch_to(None)
        """
        if name is not None and name not in self._names:
            raise KeyError(f"no delta named {name!r} is loaded (loaded: {self._names}; None is the base)")
        if self._rows is not None:
            raise RuntimeError("cannot switch the weights while rows are being served (inside `rows(...)`)")
        if name == self._in_place:
            return
        if self._plan is None:
            self._plan = _SwitchPlan(self._layers)
        plan = self._plan
        if plan.packed is not None:
            raise RuntimeError(f"cannot switch the weights in place: {plan.packed!r} is a bitsandbytes quantized layer "
                               "(its packed weight cannot take the delta's entries); serve every row with the "
                               "delta instead: rows([name] * batch)")
        off = -1 if self._in_place is None else self._names.index(self._in_place)
        on = -1 if name is None else self._names.index(name)
        saved = plan.buffers(on) if on >= 0 else []
        with torch.no_grad():
            for param, original in self._dense_saved:  # the previous delta's heads out first
                param.copy_(original)
            # One call for the whole model: every layer's restore and apply, fused per block of rows. The banks
            # were checked as they were built; the op still checks what it reads through.
            _ops.delta_bank_switch_(plan.weights(), plan.banks, off, on,
                                    [layer.saved for layer in plan.layers] if off >= 0 else [], saved,
                                    backend=self.backend, trusted_banks=True)
            dense_saved = []
            for layer in plan.headed:
                for param, part in zip((layer.module.weight, layer.module.bias), layer.heads.get(name, ())):
                    if part is not None:
                        dense_saved.append((param, param.detach().clone()))
                        param.copy_(part)
        for i, layer in enumerate(plan.layers):
            layer.saved = saved[i] if on >= 0 else None
        self._dense_saved = dense_saved
        self._in_place = name

    @property
    def in_place(self) -> str | None:
        """The delta `switch_to` put into the weights, or None."""
        return self._in_place

    def _refuse_in_place(self, what: str) -> None:
        if self._in_place is not None:
            raise RuntimeError(f"cannot {what} while {self._in_place!r} is applied in place (switch_to(None) first)")

    # -- serving --------------------------------------------------------------------------

    @contextlib.contextmanager
    def rows(self, delta_names: Sequence[str | None], *, expand: int = 1) -> Iterator[None]:
        """Serve the batch's rows with these deltas inside the block: one name (or None) per row.

        Args:
            delta_names: `[batch]` loaded names, None for the base model.
            expand: each name stands for this many consecutive rows (generate's beams or samples).

        Raises:
            KeyError: a name that is not loaded (nothing changes).

        Example:
            >>> base = torch.nn.Linear(4, 3)
            >>> served = ServedDeltas(base)
            >>> with served.rows([None, None]):
            ...     y = base(torch.randn(2, 4))
        """
        names = list(delta_names)
        self._refuse_in_place("serve rows")
        unknown = [n for n in names if n is not None and n not in self._names]
        if unknown:
            raise KeyError(f"no delta named {unknown[0]!r} is loaded (loaded: {self._names}; None serves the base)")
        if not isinstance(expand, int) or expand < 1:
            raise ValueError(f"expand must be an int >= 1, got {expand!r}")
        ids = torch.tensor([-1 if n is None else self._names.index(n) for n in names], dtype=torch.int32)
        outer = self._rows
        # All rows on the base: no hook has anything to add.
        self._rows = _Rows(names, ids, expand) if bool((ids >= 0).any()) else None
        try:
            yield
        finally:
            self._rows = outer

    def forward(self, *args, delta_names: Sequence[str | None] | None = None, **kwargs):
        """The model's forward with the rows served by `delta_names` (None: as the enclosing `rows`)."""
        if delta_names is None:
            return self.model(*args, **kwargs)
        with self.rows(delta_names):
            return self.model(*args, **kwargs)

    __call__ = forward

    def generate(self, *args, delta_names: Sequence[str | None] | None = None, **kwargs):
        """The model's `generate` with each row (through every decode step) served by its delta.

        Beams and returned sequences: each name serves the rows generate makes of its row.
        """
        if delta_names is None:
            return self.model.generate(*args, **kwargs)
        config = getattr(self.model, "generation_config", None)
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1) or 1)
        samples = kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1) or 1)
        with self.rows(delta_names, expand=beams if beams > 1 else samples):
            return self.model.generate(*args, **kwargs)


def _is_conv1d(module: nn.Module | None) -> bool:
    # transformers.pytorch_utils.Conv1D (GPT-2), matched by name so transformers stays optional here.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _is_linear(module: nn.Module | None) -> bool:
    """A layer computing `x W^T + b` (nn.Linear) or `x W + b` (transformers' Conv1D)."""
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _heads(delta: SparseDelta, modules: dict[str, nn.Module], state: dict[str, torch.Tensor],
           problems: list[str]) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """The delta's dense parts that rows can be served with: an nn.Linear's weight or bias (a task head
    trained densely), as `{module name: (weight, bias)}` (None: the layer's own). Any other dense part
    (a norm, an embedding) is added to `problems`, named: it is refused, never dropped."""
    heads: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    for param, t in delta.dense.items():
        owner, _, leaf = param.rpartition(".")
        module, p = modules.get(owner), state.get(param)
        if p is None:
            problems.append(f"{param}: no such param in the model (a dense part)")
        elif (leaf not in ("weight", "bias") or type(module) is not nn.Linear
              or getattr(module, leaf) is not p):
            what = type(module).__name__ if module is not None else "no module"
            problems.append(f"{param}: a dense part of a {what} (it replaces the param whole) cannot be served per "
                            "row, only an nn.Linear's weight or bias (a task head); apply this fine-tune in place "
                            "(SparseDelta.apply_ or switch_to) instead")
        elif tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
            problems.append(f"{param}: the dense part is {t.dtype} {tuple(t.shape)}, the model's param "
                            f"{p.dtype} {tuple(p.shape)}")
        else:
            weight, bias = heads.get(owner, (None, None))
            part = t.detach().to(p.device).clone()
            heads[owner] = (part, bias) if leaf == "weight" else (weight, part)
    return heads


def _param_of(model: nn.Module, name: str) -> torch.Tensor | None:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return None


def _increments(module: nn.Module, indices: torch.Tensor, values: torch.Tensor,
                bank: DeltaBank | PackedDeltaBank | None, n_before: int) -> DeltaBank | PackedDeltaBank:
    """`bank` (or a new one with `n_before` empty deltas) with one more delta of `module`'s weight: the
    increments `apply_` makes in a 16-bit weight at `indices`, `fp32(dtype(w + v)) - fp32(w)`, or the
    values `v` of an fp32 weight or of a quantized layer (its frozen delta adds v to the dequantized
    weight). A transposed weight (Conv1D's `[in, out]`) gives its entry at flat `in * out_features + out`
    to output row `out`."""
    weight = module.weight
    idx = indices.to(weight.device).long()
    made = values.to(weight.device).float()
    quantized = is_quantized_linear(module)
    if weight.dtype in (torch.bfloat16, torch.float16) and not quantized:
        # fp32(w) + made rounds back to dtype(w + v) (the difference of two 16-bit values is exact in fp32, or
        # off by far less than half a 16-bit unit), so `switch_to` adds these and still gets apply_'s bits. An
        # fp32 weight keeps v itself: fp32(dtype(w + v)) - w may lose a bit, and w + v is what apply_ computes.
        with torch.no_grad():
            old = weight.detach().reshape(-1)[idx].float()
            made = (old + made).to(weight.dtype).float() - old
    if quantized:
        n_rows, n_cols = module.out_features, module.in_features
    else:
        n_rows, n_cols = reversed(weight.shape) if _is_conv1d(module) else weight.shape
    rows, cols = (idx % n_rows, idx // n_rows) if _is_conv1d(module) else (idx // n_cols, idx % n_cols)
    if bank is None:  # the layer's first delta: the ones loaded before have no entries in it
        bank = DeltaBank.from_rows_and_cols((n_rows, n_cols), [_no_entries()] * n_before, device=weight.device)
    return bank.appended(rows, cols, made)
