"""Which front end each request's outputs go to, when one engine core serves several.

``octavo serve --api-server-count N`` runs N API server processes in front of one engine core;
each one sends its requests with its ``client_index`` and must get back the outputs of those
requests only. ``OutputRouter`` remembers the client of every request the core holds and splits
a step's outputs into one list per client (so each client gets one message per step). With one
client it remembers nothing: everything goes to client 0.
"""

from __future__ import annotations

import logging

from octavo.messages.engine_core import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)


class OutputRouter:
    """Request id -> client index, for the requests the engine core holds.

    :param num_clients: how many front ends send requests (>= 1).
    """

    def __init__(self, num_clients: int) -> None:
        assert num_clients >= 1, f"an engine core needs at least one client, got {num_clients}"
        self.num_clients = num_clients
        self._client_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._client_of)

    def add(self, request: EngineCoreRequest) -> None:
        """Remember whom ``request`` came from (before the core queues it).

        :raises ValueError: its id is in use (by any client's request), or its client index
            is out of range; nothing was recorded.
        """
        if self.num_clients == 1:
            return
        index = request.client_index
        if not 0 <= index < self.num_clients:
            raise ValueError(f"client_index {index} is out of range (0..{self.num_clients - 1})")
        if request.request_id in self._client_of:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._client_of[request.request_id] = index

    def forget(self, request_ids: list[str]) -> None:
        """The requests ended outside a step (aborted, stopped, refused)."""
        if self.num_clients == 1:
            return
        for request_id in request_ids:
            self._client_of.pop(request_id, None)

    def client_of(self, request_id: str) -> int | None:
        """The client of a request the core holds (None if unknown)."""
        if self.num_clients == 1:
            return 0
        return self._client_of.get(request_id)

    def split(self, outputs: list[EngineCoreOutput]) -> list[list[EngineCoreOutput]]:
        """One list of outputs per client, in step order; finished requests are forgotten.

        An output of a request no client is known for (cannot happen unless the core makes
        one for a request it was never given) is logged and dropped.
        """
        if self.num_clients == 1:
            return [outputs]
        per_client: list[list[EngineCoreOutput]] = [[] for _ in range(self.num_clients)]
        client_of = self._client_of
        for output in outputs:
            if output.finish_reason is None:
                index = client_of.get(output.request_id)
            else:
                index = client_of.pop(output.request_id, None)
            if index is None:
                logger.warning("dropped an output of request %s: no client sent it",
                               output.request_id)
                continue
            per_client[index].append(output)
        return per_client
