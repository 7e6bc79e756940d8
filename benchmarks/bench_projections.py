"""A compiled cycle's projections of a few rows as MKL's GEMM against the fused reduction (`forwards.linear`), whole
generations at batch 1, the two forms side by side in interleaved rounds.

    python benchmarks/bench_projections.py --zoo $ZOO [--policies "autoregressive;fixed:4;fixed:8"] [--rounds 3]

One engine per form (`forwards.few_rows` 0: F.linear everywhere; FEW_ROWS: fused up to that many rows), each built
with its form, over the same models; compiled steps are replayed without dynamo's guards, so each engine keeps the
form it was built with. Prints, per policy and form, the median round's tokens/s and milliseconds a cycle over the
zoo's held-out prompts, and whether both forms decoded the same tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from blockpilot.data.sources import zoo_prompts
from blockpilot.decoding import GenerationConfig, GenerationRequest, forwards, generate_many
from blockpilot.decoding.engine import Engine
from blockpilot.models import load_models
from blockpilot.policies.resolve import resolve_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", type=Path, required=True, help="a zoo folder (target/, drafter/, its prompts)")
    parser.add_argument("--policies", default="autoregressive;fixed:4;fixed:8", help="policy specs, ';'-separated")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    models = load_models(args.zoo / "target", args.zoo / "drafter")
    prompts = [models.encode_prompt(r.turns[0]) for r in zoo_prompts(args.zoo, "heldout")[: args.prompts]]
    stop = tuple(models.stop_token_ids())
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=0, stop_token_ids=stop
    )
    policies = {spec: resolve_policy(spec, models) for spec in args.policies.split(";")}
    forms = {"F.linear": 0, f"fused <= {forwards.FEW_ROWS} rows": forwards.FEW_ROWS}
    engines: dict[str, Engine] = {}

    def run(form: str, spec: str) -> tuple[float, list]:
        started = time.perf_counter()
        requests = [GenerationRequest(list(p), config, policies[spec]) for p in prompts]
        results = [generate_many(models, [request], engine=engines[form])[0] for request in requests]
        return time.perf_counter() - started, results

    tokens: dict[tuple[str, str], list[list[int]]] = {}
    for form, rows in forms.items():  # each engine's steps are built (and compiled) under its own form
        forwards.few_rows = rows
        engines[form] = Engine(models, width=8, compile="compile", sampling=args.temperature > 0)
        for spec in policies:
            tokens[form, spec] = [r.token_ids for r in run(form, spec)[1]]
    rounds: dict[tuple[str, str], list[tuple[float, list]]] = {key: [] for key in tokens}
    for _ in range(args.rounds):
        for spec in policies:
            for form in forms:
                rounds[form, spec].append(run(form, spec))
    for spec in policies:
        same = len({str(tokens[form, spec]) for form in forms}) == 1
        print(f"{spec}: the same tokens in both forms: {same}")
        for form in forms:
            seconds, results = sorted(rounds[form, spec], key=lambda r: r[0])[args.rounds // 2]
            count, cycles = sum(len(r.token_ids) for r in results), sum(r.cycles for r in results)
            cycle_ms = 1e3 * sum(r.decode_time_s for r in results) / max(cycles, 1)
            tau = (count - len(results)) / max(cycles, 1)
            print(f"  {form:18s} {count / seconds:9.1f} tokens/s  {cycle_ms:.3f} ms a cycle  tau {tau:.2f}")


if __name__ == "__main__":
    main()
