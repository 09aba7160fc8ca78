"""Run one trigger as the triggerer does, under asyncio's debug mode, and report each callback that held
the event loop longer than 50 ms (``python -m tests.fakeapi.loop_probe <class path> <kwargs as JSON>``).

It prints one JSON line: the trigger's first event and the slow callbacks asyncio reported
("Executing <Task ...> took 0.213 seconds"). The triggerer's modules and the trigger's own module
are imported before the loop starts, as a triggerer has them imported before it runs a trigger.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from typing import Any

SLOW_CALLBACK_SECONDS = 0.05


class SlowCallbacks(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            self.found.append(message)


def main(class_path: str, kwargs: dict[str, Any]) -> None:
    import airflow.jobs.triggerer_job_runner  # noqa: F401  (the triggerer's own modules)

    module, _, name = class_path.rpartition(".")
    trigger_class = getattr(importlib.import_module(module), name)
    slow = SlowCallbacks()
    logging.getLogger("asyncio").addHandler(slow)
    logging.getLogger("asyncio").setLevel(logging.WARNING)

    async def first_event() -> Any:
        asyncio.get_running_loop().slow_callback_duration = SLOW_CALLBACK_SECONDS
        async for event in trigger_class(**kwargs).run():
            return event.payload
        return None

    payload = asyncio.run(first_event(), debug=True)
    print(json.dumps({"event": payload, "slow": slow.found}, default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
