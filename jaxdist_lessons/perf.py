"""Two old names that the appendix still calls ``perf.*``; they live in ``hlo`` and ``residuals``.

``perf.py`` was a grab-bag, now split into ``hlo`` (program text), ``residuals`` (what autodiff
saves), ``compiled`` (memory reports) and ``benchmark`` (timing, utilisation, the strategy
table). Delete this file once ``book/appendix_seed_errata.md`` and ``seed.py`` call
``hlo.instruction_count`` and ``residuals.residual_bytes``.
"""

from jaxdist_lessons.hlo import instruction_count
from jaxdist_lessons.residuals import residual_bytes

__all__ = ["instruction_count", "residual_bytes"]
