"""The operator's side: what runs on the machine of whoever starts and follows runs.

    runs                 a deployed stack and its runs, read through AWS's APIs
    run_command          `trainfleet run start|list|status|watch|logs|stop|report`
    live_view            the live view of `trainfleet run watch` (rich)
    checkpoint_command   `trainfleet checkpoint list|export`, `trainfleet sample`
    validate             `trainfleet validate`: sam validate --lint and statelint
"""
