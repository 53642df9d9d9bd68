"""The expert-parallel sizes a checkpoint allows: the divisors of its expert count.

The count comes from the checkpoint and may be absurd (10**12 experts, a 61-bit prime, a number
thousands of digits long), so the divisors are built from the count's prime factors, found by trial
division up to a fixed bound and a primality test of what is left, never by counting up to it; and
only the smallest few are listed, with how many more there are. A cofactor that is neither 1 nor a
provable prime is not split further: the sizes listed are then those up to the trial bound, which
every real expert-parallel size is, and the total is not claimed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

LISTED = 24  # sizes a report or a message lists before it says how many more there are
TRIAL = 1 << 16  # trial division bound: a factor below it is found in at most TRIAL/2 divisions
_PRIME_TEST_BITS = 256  # above this, a leftover cofactor is not tested (each test would cost more than it is worth)
_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)  # Miller-Rabin: exact below 3.3e24, sound beyond


def _probably_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def factor(n: int) -> Tuple[Dict[int, int], int]:
    """``(primes, rest)``: ``n == prod(p**e) * rest``, where ``rest`` is 1 or a composite whose prime
    factors all exceed :data:`TRIAL` and which was not split (``n`` must be a positive integer)."""
    primes: Dict[int, int] = {}
    d = 2
    while d <= TRIAL and d * d <= n:
        if n % d == 0:
            n //= d
            primes[d] = primes.get(d, 0) + 1
            continue
        d += 1 if d == 2 else 2
    if n == 1:
        return primes, 1
    # No factor up to d (or up to sqrt(n)): below d*d the rest is prime; above it, only a test can tell.
    if n < d * d or (n.bit_length() <= _PRIME_TEST_BITS and _probably_prime(n)):
        primes[n] = primes.get(n, 0) + 1
        return primes, 1
    return primes, n


@dataclass(frozen=True)
class Sizes:
    """The smallest divisors of a count (at most :data:`LISTED`) and how many it has in all (None
    where the count was not fully factored: ``listed`` then holds only sizes up to :data:`TRIAL`)."""

    listed: Tuple[int, ...]
    total: Optional[int]

    @property
    def more(self) -> Optional[int]:
        """How many sizes are not listed (None: an unknown number, maybe none)."""
        return None if self.total is None else self.total - len(self.listed)

    def __str__(self) -> str:
        text = "[" + ", ".join(map(str, self.listed)) + "]"
        if self.total is None:
            return text + f" (those up to {TRIAL}; larger ones not counted)"
        return text + (f" and {self.more} more" if self.more else "")


def divisors(n: int, limit: int = LISTED) -> Sizes:
    """The smallest ``limit`` divisors of ``n`` in increasing order, and their number (none for a
    count below 1)."""
    if not isinstance(n, int) or n < 1:
        return Sizes((), 0)
    primes, rest = factor(n)
    ps = sorted(primes)
    total = math.prod(e + 1 for e in primes.values()) if rest == 1 else None
    bound = None if rest == 1 else TRIAL
    # Each divisor made once, smallest first: from d (largest prime ps[i], to the power k) come d*ps[i]
    # (while k < its exponent) and d*ps[j] for j > i.
    listed: List[int] = []
    heap = [(1, -1, 0)]
    while heap and len(listed) < limit:
        d, i, k = heapq.heappop(heap)
        if bound is not None and d > bound:
            break
        listed.append(d)
        if i >= 0 and k < primes[ps[i]]:
            heapq.heappush(heap, (d * ps[i], i, k + 1))
        for j in range(i + 1, len(ps)):
            heapq.heappush(heap, (d * ps[j], j, 1))
    return Sizes(tuple(listed), total)


def valid_ep_sizes(num_experts: int, stage_size: Optional[int] = None) -> Sizes:
    """The AutoEP sizes DeepSpeed accepts for ``num_experts`` experts (and a stage of ``stage_size``
    ranks): the divisors of both, the smallest :data:`LISTED` of them listed."""
    return divisors(num_experts if stage_size is None else math.gcd(num_experts, stage_size))
