"""Which adapters the engine holds: loaded ones (an LRU of --max-cpu-loras) and resident ones (--max-loras
device slots, LRU too), and the per-step mapping of batch rows to slots.

The scheduler never puts more than --max-loras distinct adapters in one step, so a step's adapters always
fit: a missing one takes a free slot or the least recently used slot no request of this step needs.
Adapters are loaded and checked when a request (or the server's load route) first names them; an adapter
evicted from the loaded LRU is read again from its directory when it is next needed.
add_lora / remove_lora may be called from another thread (the server's routes); slots are the engine's.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from vllmpy.config import LoRAConfig
from vllmpy.lora.checkpoint import LoRAAdapter, load_adapter
from vllmpy.lora.layer import LoRALayer, LoRAMapping, LoRAStep
from vllmpy.lora.request import LoRARequest
from vllmpy.models.base import CausalLM


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.device, self.dtype = device, dtype
        self.step = LoRAStep()
        # A layer gets its slots (and its hook) when the first adapter that targets it is written: layers no
        # adapter touches (a vision tower's, say) never see the step's mapping.
        self.layers: dict[str, LoRALayer] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        # ids removed or loaded anew (another path under the same id) since the engine last looked at its slots
        self._stale: set[int] = set()
        self._lock = threading.Lock()
        self._slots: list[int | None] = [None] * self.max_loras  # adapter id resident in each slot
        self._slot_order: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first

    def add_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Load and check the adapter (a LoRAError names what is refused) and keep it loaded. One read from
        its directory also refreshes a slot the id may hold (the files, or the path, may have changed)."""
        adapter, fresh = self._load(request)
        if fresh:
            with self._lock:
                self._stale.add(request.lora_int_id)
        return adapter

    def _load(self, request: LoRARequest) -> tuple[LoRAAdapter, bool]:
        """The loaded adapter, read from its directory (True) unless the LRU holds it for this path."""
        with self._lock:
            adapter = self._loaded.get(request.lora_int_id)
            if adapter is not None and adapter.request.lora_path == request.lora_path:
                self._loaded.move_to_end(request.lora_int_id)
                return adapter, False
        adapter = load_adapter(request, self.model, self.max_rank)
        with self._lock:
            self._loaded[request.lora_int_id] = adapter
            self._loaded.move_to_end(request.lora_int_id)
            while len(self._loaded) > self.max_cpu_loras:
                self._loaded.popitem(last=False)
        return adapter, True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget the adapter; its slot is freed before the engine's next step with adapters."""
        with self._lock:
            self._stale.add(lora_int_id)
            return self._loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        with self._lock:
            return set(self._loaded)

    @contextlib.contextmanager
    def running(self, requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> Iterator[None]:
        """One forward over chunks on these adapters (None: the base model), `num_tokens` rows each."""
        self.step.mapping = self._map(requests, num_tokens)
        try:
            yield
        finally:
            self.step.mapping = None

    def _map(self, requests: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> LoRAMapping | None:
        needed = {request.lora_int_id: request for request in requests if request is not None}
        if not needed:
            return None
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} LoRA adapters in one step but --max-loras is {self.max_loras} "
                               f"(the scheduler bounds this)")
        self._free_stale()
        slot_of = {lora_id: self._activate(request, needed) for lora_id, request in needed.items()}
        chunks = [(-1 if r is None else slot_of[r.lora_int_id], n) for r, n in zip(requests, num_tokens)]
        return LoRAMapping.build(chunks, self.device)

    def _free_stale(self) -> None:
        with self._lock:
            stale, self._stale = self._stale, set()
        for slot, lora_id in enumerate(self._slots):
            if lora_id in stale:
                self._slots[slot] = None
                self._slot_order.pop(slot, None)

    def _activate(self, request: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        """The adapter's slot, written now if it is not resident (free slot first, else the LRU one unneeded)."""
        lora_id = request.lora_int_id
        if lora_id in self._slots:
            slot = self._slots.index(lora_id)
        else:
            free = [slot for slot, held in enumerate(self._slots) if held is None]
            slot = free[0] if free else next(s for s in self._slot_order if self._slots[s] not in needed)
            adapter, _ = self._load(request)  # written into the slot now: nothing to refresh
            for name in [*self.layers, *(name for name in adapter.deltas if name not in self.layers)]:
                self._layer(name).write(slot, adapter.deltas.get(name))
            self._slots[slot] = lora_id
        self._slot_order[slot] = None
        self._slot_order.move_to_end(slot)
        return slot

    def _layer(self, name: str) -> LoRALayer:
        layer = self.layers.get(name)
        if layer is None:
            module = self.model.get_submodule(name)
            module.lora = layer = self.layers[name] = LoRALayer(module, self.step, self.max_loras, self.max_rank,
                                                                self.dtype, self.device)
        return layer
