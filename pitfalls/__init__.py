"""The pitfall lab: the failure modes the lock articles warn about, reproduced on demand on
servers of their own, each run the naive way and the shop's way, and measured."""
