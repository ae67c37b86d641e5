"""Defaults the library and the CLI share, in a module that imports nothing: every ``dpfl``
command reads them while it lists its options, before any accounting library is loaded."""

#: the accountant a scenario or ``dpfl privacy`` uses unless told otherwise
DEFAULT_ACCOUNTANT = "pld"
#: where searches over the number of rounds stop ("at least this many")
DEFAULT_MAX_ROUNDS = 10**7
#: the default floor of Fu et al.'s adaptive clipping threshold (privacy.adap_dpfl.min_clip_norm; the
#: reason for its value: algorithms/adap_dpfl_core.py)
MIN_CLIP_NORM = 1e-6
#: the largest noise multiplier a scenario or ``dpfl privacy`` takes: above it epsilon is 0 to every
#: printed digit, and dp_accounting's arithmetic overflows near 1e200
MAX_NOISE_MULTIPLIER = 1e6
#: the smallest: epsilon means nothing long before it (about 5e17 for one round at q = 0.01), and
#: dp_accounting's PLD divides by zero near 1e-150
MIN_NOISE_MULTIPLIER = 1e-9
#: a straggler's delay, at most a day (faults.stragglers): the clock's deadlines overflow long before
#: 1e308 s; a lognormal draw beyond it is cut to it
MAX_LATENCY_S = 86_400.0
