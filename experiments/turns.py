"""Turn-taking between benchmark processes that share one machine (experiments/benchmark_vs_trl.py).

A child process that takes turns prints one line ``TURN <json>`` on stdout whenever it finishes a turn
(its warm-up, or a block of measured steps), then blocks until the driver writes a line on its stdin;
end of input also lets it go on, so the driver closes stdin to let a child finish. The measured steps of
a child run while every other child is blocked, so each side has the machine to itself, and the sides
alternate in one run.

Standard library only: the TRL side (experiments/trl_tiny_grpo.py) runs in another Python environment
and loads this file by path.
"""
from __future__ import annotations

import json
import subprocess
import sys

PREFIX = "TURN "


def end_turn(report: dict) -> None:
  """Child side: hands ``report`` to the driver, then waits for the next turn."""
  sys.stdout.write(PREFIX + json.dumps(report, sort_keys=True) + "\n")
  sys.stdout.flush()
  sys.stdin.readline()


class Child:
  """Driver side: one long-lived child process; ``next_turn`` lets it run until it ends a turn."""

  def __init__(self, name: str, args: list[str], log_path: str, env: dict | None = None):
    self.name, self.log_path = name, log_path
    self.log = open(log_path, "w")  # pylint: disable=consider-using-with
    self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                 text=True, bufsize=1, env=env)
    self.other_lines: list[str] = []

  def wait_turn(self) -> dict:
    """The report of the turn the child is running; other stdout lines are kept in ``other_lines``."""
    for line in self.proc.stdout:
      if line.startswith(PREFIX):
        return json.loads(line[len(PREFIX):])
      self.other_lines.append(line.rstrip("\n"))
    raise RuntimeError(f"{self.name} exited (status {self.proc.wait()}) before ending its turn; "
                       f"log: {self.log_path}\n{self.tail()}")

  def next_turn(self) -> dict:
    self.proc.stdin.write("\n")
    self.proc.stdin.flush()
    return self.wait_turn()

  def finish(self) -> list[str]:
    """Closes stdin, waits for the child to exit and returns its remaining stdout lines."""
    self.proc.stdin.close()
    rest = [line.rstrip("\n") for line in self.proc.stdout]
    status = self.proc.wait()
    self.log.close()
    if status:
      raise RuntimeError(f"{self.name} failed (status {status}); log: {self.log_path}\n{self.tail()}")
    return self.other_lines + rest

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self.log.close()

  def tail(self, chars: int = 3000) -> str:
    self.log.flush()
    with open(self.log_path) as f:
      return f.read()[-chars:]
