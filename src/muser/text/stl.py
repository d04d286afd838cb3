"""libstdc++ (GCC 12, bits/stl_algo.h + bits/stl_heap.h) std::sort and std::partial_sort.

Neither is stable, so wherever the pinned llama.cpp sorts elements that compare equal (special
tokens of equal length in the tokenizer's special-token cache; equal logits in the sampler) the
order it leaves them in is the algorithm's, and matching llama.cpp token-for-token means running
the same algorithm. These operate in place on a Python list `a[first:last]` with `comp(x, y)`
meaning "x goes before y" (the C++ comparator). Callers take a fast path (any correct sort) when
no two compared elements are equal, where the result cannot differ.
"""

from __future__ import annotations

from typing import Any, Callable

Comp = Callable[[Any, Any], bool]

_THRESHOLD = 16  # _S_threshold


def _lg(n: int) -> int:
    return n.bit_length() - 1  # std::__lg


# --- heap (stl_heap.h) -------------------------------------------------------------------------


def _push_heap(a: list, first: int, hole: int, top: int, value: Any, comp: Comp) -> None:
    parent = (hole - 1) // 2
    while hole > top and comp(a[first + parent], value):
        a[first + hole] = a[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    a[first + hole] = value


def _adjust_heap(a: list, first: int, hole: int, length: int, value: Any, comp: Comp) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if comp(a[first + child], a[first + child - 1]):
            child -= 1
        a[first + hole] = a[first + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        a[first + hole] = a[first + child - 1]
        hole = child - 1
    _push_heap(a, first, hole, top, value, comp)


def make_heap(a: list, first: int, last: int, comp: Comp) -> None:
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(a, first, parent, length, a[first + parent], comp)
        if parent == 0:
            return
        parent -= 1


def _pop_heap(a: list, first: int, last: int, result: int, comp: Comp) -> None:
    value = a[result]
    a[result] = a[first]
    _adjust_heap(a, first, 0, last - first, value, comp)


def sort_heap(a: list, first: int, last: int, comp: Comp) -> None:
    while last - first > 1:
        last -= 1
        _pop_heap(a, first, last, last, comp)


def heap_select(a: list, first: int, middle: int, last: int, comp: Comp) -> None:
    make_heap(a, first, middle, comp)
    for i in range(middle, last):
        if comp(a[i], a[first]):
            _pop_heap(a, first, middle, i, comp)


def partial_sort(a: list, first: int, middle: int, last: int, comp: Comp) -> None:
    """std::partial_sort: heap_select then sort_heap."""
    heap_select(a, first, middle, last, comp)
    sort_heap(a, first, middle, comp)


# --- introsort (stl_algo.h) --------------------------------------------------------------------


def _move_median_to_first(a: list, result: int, x: int, y: int, z: int, comp: Comp) -> None:
    if comp(a[x], a[y]):
        if comp(a[y], a[z]):
            a[result], a[y] = a[y], a[result]
        elif comp(a[x], a[z]):
            a[result], a[z] = a[z], a[result]
        else:
            a[result], a[x] = a[x], a[result]
    elif comp(a[x], a[z]):
        a[result], a[x] = a[x], a[result]
    elif comp(a[y], a[z]):
        a[result], a[z] = a[z], a[result]
    else:
        a[result], a[y] = a[y], a[result]


def _unguarded_partition(a: list, first: int, last: int, pivot: int, comp: Comp) -> int:
    while True:
        while comp(a[first], a[pivot]):
            first += 1
        last -= 1
        while comp(a[pivot], a[last]):
            last -= 1
        if not first < last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def _introsort_loop(a: list, first: int, last: int, depth: int, comp: Comp) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            partial_sort(a, first, last, last, comp)
            return
        depth -= 1
        mid = first + (last - first) // 2
        _move_median_to_first(a, first, first + 1, mid, last - 1, comp)
        cut = _unguarded_partition(a, first + 1, last, first, comp)
        _introsort_loop(a, cut, last, depth, comp)
        last = cut


def _unguarded_linear_insert(a: list, last: int, comp: Comp) -> None:
    val = a[last]
    nxt = last - 1
    while comp(val, a[nxt]):
        a[last] = a[nxt]
        last = nxt
        nxt -= 1
    a[last] = val


def _insertion_sort(a: list, first: int, last: int, comp: Comp) -> None:
    if first == last:
        return
    for i in range(first + 1, last):
        if comp(a[i], a[first]):
            val = a[i]
            a[first + 1 : i + 1] = a[first:i]
            a[first] = val
        else:
            _unguarded_linear_insert(a, i, comp)


def _final_insertion_sort(a: list, first: int, last: int, comp: Comp) -> None:
    if last - first > _THRESHOLD:
        _insertion_sort(a, first, first + _THRESHOLD, comp)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(a, i, comp)
    else:
        _insertion_sort(a, first, last, comp)


def sort(a: list, first: int, last: int, comp: Comp) -> None:
    """std::sort: introsort (median-of-three, depth limit 2*lg(n)) + final insertion sort."""
    if last - first > 1:
        _introsort_loop(a, first, last, 2 * _lg(last - first), comp)
        _final_insertion_sort(a, first, last, comp)
