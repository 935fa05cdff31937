"""Runs in the formats venv (make test-formats: torch, torchrl, tensordict, flashbax): writes
torchrl buffer dumps and flashbax Vaults with the libraries themselves, and saves what the
libraries read back from them as ``.npy`` files, for the main venv's tests to compare.

Usage:
  python formats_peer.py ROOT

Writes ``ROOT/<case>/`` (the dump or Vault) and ``ROOT/<case>.expect/<leaf>.npy`` (the
library's own read: torchrl's storage rows in storage order after ``ReplayBuffer.loads``,
flashbax's ``Vault.read()`` as ``(batch, time, ...)``), plus ``ROOT/cases.json``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np


def _save_expect(root: str, case: str, leaves: dict[str, np.ndarray], info: dict[str, Any]) -> None:
    out = os.path.join(root, case + ".expect")
    os.makedirs(out, exist_ok=True)
    for i, (key, value) in enumerate(leaves.items()):
        np.save(os.path.join(out, f"{i}.npy"), value)
        info.setdefault("files", {})[key] = f"{i}.npy"
    with open(os.path.join(out, "info.json"), "w") as f:
        json.dump(info, f)


def _flat_td(td: Any) -> dict[str, np.ndarray]:
    import torch

    out = {}
    for key in td.keys(include_nested=True, leaves_only=True):
        name = "/".join(key) if isinstance(key, tuple) else key
        t = td.get(key)
        if t.dtype == torch.bfloat16:
            t = t.float()  # numpy has no bfloat16 of its own: compared as float32
        out[name] = t.detach().cpu().numpy()
    return out


def torchrl_cases(root: str) -> list[str]:
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
    from torchrl.data.replay_buffers.checkpointers import H5StorageCheckpointer

    def transitions(n: int, start: int, bf16: bool = True) -> TensorDict:
        g = torch.Generator().manual_seed(start)
        idx = torch.arange(start, start + n)
        done = (idx % 7 == 6).unsqueeze(-1)
        td = TensorDict(
            {
                "index": idx,
                "observation": torch.randn(n, 4, generator=g),
                "pixels": torch.randint(0, 255, (n, 3, 8, 8), dtype=torch.uint8, generator=g),
                "action": torch.randint(0, 5, (n,), generator=g),
                "hidden": torch.randn(n, 2, generator=g).to(torch.bfloat16),
                "next": TensorDict(
                    {
                        "observation": torch.randn(n, 4, generator=g),
                        "reward": torch.randn(n, 1, generator=g),
                        "done": done,
                        "terminated": done.clone(),
                    },
                    [n],
                ),
            },
            [n],
        )
        # H5StorageCheckpointer writes through numpy, which has no bfloat16.
        return td if bf16 else td.exclude("hidden")

    def storage(capacity: int, h5: bool) -> LazyMemmapStorage:
        out = LazyMemmapStorage(capacity)
        if h5:
            out.checkpointer = H5StorageCheckpointer()
        return out

    cases = []
    for case, capacity, chunks in (
        ("torchrl_partial", 100, [30, 34]),  # 64 of 100 rows filled
        ("torchrl_wrapped", 48, [30, 34, 20]),  # 84 rows through 48 slots
        ("torchrl_h5_partial", 100, [30, 34]),  # the same through checkpoint.h5
        ("torchrl_h5_wrapped", 48, [30, 34, 20]),
    ):
        h5 = "_h5_" in case
        rb = ReplayBuffer(storage=storage(capacity, h5))
        start = 0
        for n in chunks:
            rb.extend(transitions(n, start, bf16=not h5))
            start += n
        path = os.path.join(root, case)
        rb.dumps(path)
        back = ReplayBuffer(storage=storage(capacity, h5))
        back.loads(path)
        length = len(back)
        cursor = int(back._writer._cursor)
        _save_expect(
            root,
            case,
            _flat_td(back.storage[:length]),
            {"len": length, "capacity": capacity, "cursor": cursor, "written": start},
        )
        cases.append(case)

    rb = ReplayBuffer(storage=LazyTensorStorage(40))  # a pytree storage: a dict of tensors
    rb.extend(
        {
            "index": torch.arange(25),
            "obs": {"pos": torch.randn(25, 3), "vel": torch.randn(25, 3).double()},
            "flag": torch.arange(25) % 3 == 0,
        }
    )
    path = os.path.join(root, "torchrl_pytree")
    rb.dumps(path)
    stored = rb.storage[:25]
    leaves = {
        "flag": stored["flag"].numpy(),
        "index": stored["index"].numpy(),
        "obs/pos": stored["obs"]["pos"].numpy(),
        "obs/vel": stored["obs"]["vel"].numpy(),
    }
    _save_expect(root, "torchrl_pytree", leaves, {"len": 25, "capacity": 40, "cursor": 25})
    cases.append("torchrl_pytree")
    return cases


def vault_cases(root: str) -> list[str]:
    import flashbax as fbx
    import jax
    import jax.numpy as jnp
    from flashbax.vault import Vault

    batch, buffer_time = 4, 16
    buf = fbx.make_trajectory_buffer(
        max_length_time_axis=buffer_time,
        min_length_time_axis=1,
        sample_batch_size=1,
        add_batch_size=batch,
        sample_sequence_length=1,
        period=1,
    )
    agents = 3
    item = {
        "index": jnp.int32(0),
        "observations": jnp.zeros((agents, 5), jnp.float32),
        "actions": jnp.zeros((agents,), jnp.int32),
        "rewards": jnp.zeros((agents,), jnp.float32),
        "terminals": jnp.zeros((agents,), bool),
        "truncations": jnp.zeros((agents,), bool),
        "infos": {"state": jnp.zeros((7,), jnp.float32)},
    }
    state = buf.init(item)
    vault = Vault(
        vault_name="peer.vlt", experience_structure=state.experience, rel_dir=root, vault_uid="uid0"
    )
    key = jax.random.PRNGKey(0)
    time = 0
    # 40 steps through a 16-step buffer, written to the Vault every 10 (wrapping the buffer).
    for block in range(4):
        steps = 10
        t = jnp.arange(time, time + steps)
        key, k1, k2 = jax.random.split(key, 3)
        fake = {
            # Each step's record number in our order: batch row by batch row.
            "index": (jnp.arange(batch)[:, None] * 40 + t[None, :]).astype(jnp.int32),
            "observations": jax.random.normal(k1, (batch, steps, agents, 5)),
            "actions": jax.random.randint(k2, (batch, steps, agents), 0, 4),
            "rewards": jnp.ones((batch, steps, agents)) * t[None, :, None],
            "terminals": jnp.broadcast_to((t % 9 == 8)[None, :, None], (batch, steps, agents))
            & (jnp.arange(agents) == 0),
            "truncations": jnp.broadcast_to((t % 13 == 12)[None, :, None], (batch, steps, agents)),
            "infos": {"state": jnp.ones((batch, steps, 7)) * block},
        }
        state = buf.add(state, fake)
        vault.write(state)
        time += steps
    read = Vault(vault_name="peer.vlt", rel_dir=root, vault_uid="uid0").read().experience
    leaves = {
        "/".join(str(getattr(p, "key", getattr(p, "name", p))) for p in path): np.asarray(v)
        for path, v in jax.tree_util.tree_flatten_with_path(read)[0]
    }
    _save_expect(root, "peer.vlt", leaves, {"vault_index": int(vault.vault_index)})
    return ["peer.vlt"]


def main() -> None:
    root = os.path.abspath(sys.argv[1])
    os.makedirs(root, exist_ok=True)
    cases = torchrl_cases(root) + vault_cases(root)
    with open(os.path.join(root, "cases.json"), "w") as f:
        json.dump(cases, f)
    print("wrote", cases)


if __name__ == "__main__":
    main()
