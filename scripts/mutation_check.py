"""Mutation check of the core: plausible wrong implementations, patched in one at a time; the tests must fail.

    .venv/bin/python scripts/mutation_check.py              # every mutant (about 15 minutes on 2 cores)
    .venv/bin/python scripts/mutation_check.py queue_ptr    # some of them, by name

Run it before a release, not in every CI run. Each mutant is a small edit of one core module (the queue, InfoNCE,
the memory bank, the momentum update, the schedules, shuffle BN, the SimCLR / BYOL / SwAV steps, the kNN vote) of
the kind a refactoring could make (an off-by-one, a swapped m and 1 − m, a permutation drawn but not applied) or a
pitfall a peer fell into (Bolts, lightly). It is applied to the working tree, the tests that should catch it run
(``pytest -x``: the first failure kills the mutant), and the file is restored, whatever happens. A surviving
mutant is a test gap; those that survive for a reason are listed in ``benchmarks/README.md`` ("Mutation check")
with the reason. Exit code 1 if a mutant not listed there survives.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


MUTANTS = [
    Mutant("queue_ptr", "moco_lightning/modules/dictionary.py", "self.ptr.copy_((self.ptr + n) % self.size)",
           "self.ptr.copy_((self.ptr + n - 1) % self.size)", ("tests/test_dictionary.py",),
           "the queue pointer moves one slot short"),
    Mutant("queue_keeps_first",
           "moco_lightning/modules/dictionary.py", "keys = keys[n - self.size :]", "keys = keys[: self.size]",
           ("tests/test_dictionary.py",), "a batch larger than K keeps its first K keys, not its newest"),
    Mutant("temperature_times", "moco_lightning/modules/loss.py", "F.cross_entropy(sims / temperature, labels)",
           "F.cross_entropy(sims * temperature, labels)", ("tests/test_loss.py",), "logits multiplied by T"),
    Mutant("positive_last", "moco_lightning/modules/loss.py", "torch.cat([l_pos, l_neg], dim=1)",
           "torch.cat([l_neg, l_pos], dim=1)", ("tests/test_loss.py",), "the positive is not in column 0"),
    Mutant("enqueue_before_loss",
           "moco_lightning/methods/contrastive.py", "        k = self.key(x_k, index)\n",
           "        k = self.key(x_k, index)\n        self.dictionary.store(*self.dictionary."
           "to_store([k], [k], index), step=self.global_step)\n",
           ("tests/test_moco.py",), "the keys are enqueued before the loss: the positive is among the negatives"),
    Mutant("momentum_forgets_head", "moco_lightning/modules/momentum.py",
           "copies = [p for name in self.pairs.values() for p in getattr(owner, name).parameters()]\n"
           "        sources = [p for name in self.pairs for p in getattr(owner, name).parameters()]",
           "copies = [p for name in list(self.pairs.values())[:1] for p in getattr(owner, name).parameters()]\n"
           "        sources = [p for name in list(self.pairs)[:1] for p in getattr(owner, name).parameters()]",
           ("tests/test_moco.py",),
           "the key head is never updated (Bolts' bug)"),
    Mutant("keys_not_gathered", "moco_lightning/methods/base.py",
           "stored = tuple(concat_all_gather(rows, self._equal_batches) for rows in stored)",
           "stored = tuple(stored)", ("tests/test_distributed.py",),
           "under DDP each rank enqueues only its own keys (lightly #1018)"),
    Mutant("validation_enqueues", "moco_lightning/methods/base.py",
           "            out = self.views_loss(self.split_batch(batch)[0][:2])\n",
           "            out = self.views_loss(self.split_batch(batch)[0][:2])\n"
           "            self.dictionary.store(*out['stored'], step=self.global_step)\n",
           ("tests/test_moco.py",), "validation enqueues its keys (Bolts #419)"),
    Mutant("knn_unweighted", "moco_lightning/downstream/knn.py", "(sim.float() / temperature).exp()",
           "torch.ones_like(sim.float())",
           ("tests/test_knn.py",), "the kNN vote ignores the similarity weights"),
    Mutant("momentum_swapped", "moco_lightning/modules/momentum.py", "torch._foreach_lerp_(copies, sources, 1.0 - m)",
           "torch._foreach_lerp_(copies, sources, m)", ("tests/test_moco.py",),
           "θ_k ← (1 − m)·θ_k + m·θ_q"),
    Mutant("momentum_index",
           "moco_lightning/methods/base.py", "self.momentum_copy.at(self, self.global_step))",
           "self.momentum_copy.at(self, self.global_step - 1))", ("tests/test_moco.py",),
           "the update after step j uses m(j − 1) (the v3 index fixed in #22)"),
    Mutant("momentum_every_micro_batch", "moco_lightning/methods/base.py",
           "if self.momentum_copy is not None and stepped:", "if self.momentum_copy is not None:",
           ("tests/test_moco.py",),
           "the momentum update runs on every batch under gradient accumulation"),
    Mutant("bank_momentum_swapped", "moco_lightning/modules/dictionary.py",
           "self.features[index].mul(momentum).add_(q[last].to(self.features.dtype), alpha=1.0 - momentum)",
           "self.features[index].mul(1.0 - momentum).add_(q[last].to(self.features.dtype), alpha=momentum)",
           ("tests/test_dictionary.py",), "v ← (1 − m)·v + m·q"),
    Mutant("warmup_from_one", "moco_lightning/training/plan.py", "return j / plan.warmup",
           "return (j + 1) / plan.warmup",
           ("tests/test_plan.py",), "the warm-up starts at lr/w, not 0"),
    Mutant("step_milestone_late", "moco_lightning/training/plan.py", "0.1 ** sum(j >= m for m in plan.milestones)",
           "0.1 ** sum(j > m for m in plan.milestones)", ("tests/test_plan.py",), "the v1 drop one step late"),
    Mutant("cosine_quarter", "moco_lightning/training/plan.py",
           "math.cos(math.pi * min(j - plan.warmup, span) / max(span, 1))",
           "math.cos(math.pi * min(j - plan.warmup, span) / max(span, 1) / 2)", ("tests/test_plan.py",),
           "a quarter cosine: the lr ends at half its peak"),
    Mutant("ddp_shuffle_not_applied", "moco_lightning/modules/distributed.py", "    return x_all[mine], (perm, counts)",
           "    return x, (torch.arange(x_all.shape[0], device=x.device), counts)", ("tests/test_distributed.py",),
           "shuffle BN across ranks draws the permutation and does not apply it"),
    Mutant("split_shuffle_not_applied", "moco_lightning/methods/contrastive.py",
           "                x = x[perm]\n", "                pass\n", ("tests/test_split_bn.py", "tests/test_moco.py"),
           "split shuffle BN draws the permutation and does not apply it"),
    Mutant("byol_not_swapped", "moco_lightning/methods/byol.py", "normalized_mse(p0, z1) + normalized_mse(p1, z0)",
           "normalized_mse(p0, z0) + normalized_mse(p1, z1)", ("tests/test_byol.py",),
           "BYOL predicts each view's own target"),
    Mutant("ntxent_self_not_masked", "moco_lightning/modules/loss.py",
           'F.cross_entropy(logits.masked_fill(mask, float("-inf")), positive)', "F.cross_entropy(logits, positive)",
           ("tests/test_simclr.py",), "NT-Xent keeps each embedding's similarity with itself"),
    Mutant("swav_frozen_one_more", "moco_lightning/methods/swav.py", "if self.global_step < self._frozen_steps:",
           "if self.global_step <= self._frozen_steps:", ("tests/test_swav.py",), "one more frozen step"),
    Mutant("swav_drops_local_views", "moco_lightning/methods/swav.py",
           "low = self.scores(list(views[2:]))[0] if len(views) > 2 else []", "low = []", ("tests/test_swav.py",),
           "SwAV's step ignores the local views"),
    Mutant("v3_scale",
           "moco_lightning/methods/v3.py", "[k1, k2], 2 * self.hparams.temperature)",
           "[k1, k2], self.hparams.temperature)",
           ("tests/test_v3.py", "tests/test_moco.py"), "v3's loss without its factor 2"),
]  # fmt: skip


def run_tests(tests: tuple[str, ...], timeout: int) -> tuple[bool, str]:
    """(passed, the last lines of pytest's output)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "2", *tests]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "timeout"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    return out.returncode == 0, (lines[-1] if lines else out.stderr[-200:])


def accepted_survivors() -> set[str]:
    """The mutants ``benchmarks/README.md`` lists as surviving for a reason (rows ``| `name` | ... survives ...``)."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    return {line.split("`")[1] for line in text.splitlines() if line.startswith("| `") and "survives" in line}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="mutants to run (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    args = p.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutants {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
    for m in chosen:  # every edit applies to today's code exactly once, before anything runs
        count = (ROOT / m.file).read_text().count(m.old)
        if count != 1:
            p.error(f"mutant {m.name}: its original text occurs {count} times in {m.file} (update the mutant)")
    files = sorted({t for m in chosen for t in m.tests})
    ok, last = run_tests(tuple(files), args.timeout)
    if not ok:
        print(f"the unmutated tests fail ({last}): fix them first", flush=True)
        return 2
    survivors = []
    for m in chosen:
        path = ROOT / m.file
        original = path.read_text()
        t = time.perf_counter()
        try:
            path.write_text(original.replace(m.old, m.new))
            passed, last = run_tests(m.tests, args.timeout)
        finally:
            path.write_text(original)
        verdict = "SURVIVED" if passed else "killed"
        if passed:
            survivors.append(m.name)
        print(f"{m.name:28s} {verdict:8s} {time.perf_counter() - t:5.0f} s  {m.what}  [{last}]", flush=True)
    accepted = accepted_survivors()
    unexplained = [n for n in survivors if n not in accepted]
    print(f"\n{len(chosen) - len(survivors)} of {len(chosen)} killed; survivors: {survivors or 'none'}", flush=True)
    if unexplained:
        print(f"not listed in benchmarks/README.md with a reason: {unexplained}", flush=True)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
