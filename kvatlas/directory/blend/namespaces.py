"""Dense small-integer ids for the namespaces that hold claims in a blend index.

An id exists exactly while its namespace holds at least one claim, checked at the end of each
write (so ids stay stable within a batch); released ids are reused. The kernels store and
compare ids only, never namespaces. Not thread-safe: the index calls it under its lock.
"""

from __future__ import annotations

from kvatlas.keys import BlendNamespace


class NamespaceIds:
    def __init__(self) -> None:
        self._ids: dict[BlendNamespace, int] = {}
        self._names: list[BlendNamespace | None] = []
        self.claims: list[int] = []
        """Per id, its namespace's claims: a new claim adds 1 here (the index's per-op path,
        without a call); a dropped one goes through :meth:`release`."""
        self._free: list[int] = []
        self._unclaimed: set[int] = set()  # ids to check at the end of the write
        # the last namespace object looked up (writers and readers mostly repeat one): its
        # id without hashing it again
        self._last: BlendNamespace | None = None
        self._last_id = -1

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, namespace: BlendNamespace) -> int | None:
        """The namespace's id, ``None`` if it holds no claim."""
        if namespace is self._last:
            return self._last_id
        ns = self._ids.get(namespace)
        if ns is not None:
            self._last, self._last_id = namespace, ns
        return ns

    def register(self, namespace: BlendNamespace) -> int:
        """The namespace's id, new if need be (released at the end of the write unless it
        gains a claim by then)."""
        if namespace is self._last:
            return self._last_id
        ns = self._ids.get(namespace)
        if ns is None:
            if self._free:
                ns = self._free.pop()
                self._names[ns] = namespace
                self.claims[ns] = 0
            else:
                ns = len(self._names)
                self._names.append(namespace)
                self.claims.append(0)
            self._ids[namespace] = ns
            self._unclaimed.add(ns)
        self._last, self._last_id = namespace, ns
        return ns

    def release(self, ns: int, dropped: int) -> None:
        """``dropped`` claims of ``ns`` went."""
        self.claims[ns] -= dropped
        if self.claims[ns] == 0:
            self._unclaimed.add(ns)

    def end_write(self) -> None:
        """Release the ids of namespaces left without claims."""
        if not self._unclaimed:
            return
        for ns in self._unclaimed:
            namespace = self._names[ns]
            if self.claims[ns] == 0 and namespace is not None:
                del self._ids[namespace]
                self._names[ns] = None
                self._free.append(ns)
                if ns == self._last_id:
                    self._last = None
        self._unclaimed.clear()
