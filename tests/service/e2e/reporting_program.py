"""A command job's program that trains nothing: it sleeps a known time per step and calls
`trainctl.report` every ``--every`` steps with the step's tokens only (no lr, grad norm or memory), and
prints what it measured itself between two reports, for tests/service/e2e/test_command_jobs_e2e.py:

    measured step 10: 0.100213 s/step 2554.5 tokens/s
"""

from __future__ import annotations

import argparse
import time

import trainctl


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, required=True)
    parser.add_argument("--tokens", type=int, required=True, help="tokens each step trains")
    args = parser.parse_args()
    previous: tuple[int, float] | None = None
    for step in range(1, args.steps + 1):
        time.sleep(args.step_seconds)
        if step % args.every:
            continue
        now = time.monotonic()
        if previous is not None:
            seconds = (now - previous[1]) / (step - previous[0])
            print(f"measured step {step}: {seconds:.6f} s/step {args.tokens / seconds:.1f} tokens/s", flush=True)
        previous = (step, now)
        trainctl.report(step=step, loss=1.0 / step, tokens=args.tokens)


if __name__ == "__main__":
    main()
