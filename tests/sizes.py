"""How many generated cases a property runs: the hypothesis profile sizes them all. `thorough`
(the default, what CI runs) gives each property the count its test names; `quick` (a
contributor's check, `python -m pytest -m quick`) a tenth of it, at least two. Properties
written as loops over generated cases take their count from `cases(n)` too, so one setting
sizes the suite rather than counts trimmed by hand."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings

THOROUGH, QUICK = "thorough", "quick"
FULL_EXAMPLES = 100  # hypothesis's own default: the thorough profile's, against which `cases` scales
# no deadline: a property's examples are timed on a machine that may be running other tests beside
# them; a slow example is not a wrong one
settings.register_profile(THOROUGH, max_examples=FULL_EXAMPLES, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(QUICK, max_examples=FULL_EXAMPLES // 10, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(THOROUGH)


def cases(n: int) -> int:
    """`n` generated cases under the thorough profile; as many fewer (at least 2) as the profile in
    force runs fewer examples than hypothesis's default."""
    scale = min(1.0, settings().max_examples / FULL_EXAMPLES)
    return n if scale == 1.0 else max(2, math.ceil(n * scale))
