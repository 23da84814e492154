"""``--num_draft_tokens=auto`` in one place: the schedule that picks the
draft length g per segment of rounds from running acceptance estimates
and round costs (``schedule``), and the round costs, prior and plain-AR
fallback it needs (``calibrate``). A fixed G never enters here."""
