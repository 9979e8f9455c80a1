"""What crosses the process boundary between the driver and its workers, in one place.

Both halves import it; neither imports the other (``_driver`` never imports ``_worker``: an
import-linter contract in ``pyproject.toml``). Going out, one :class:`~.payload.Payload` per
attempt carries the Trainer (with its strategy, :mod:`.environment` and :mod:`.precision`
request), the call and the run's :class:`~.resume_points.ResumePoint`; coming back, each worker
returns a :class:`~.results.WorkerOutput`. While a call runs, the workers' outboxes carry values
on the channels of :mod:`.channels`. :mod:`.trainer_parts` names the parts of a Trainer both
halves read, and :mod:`.artifacts` the files rank 0 sends back.
"""
