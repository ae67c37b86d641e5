"""Faults as data: the fault plan, availability traces and update corruption."""
