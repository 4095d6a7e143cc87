"""Push: push actions and notification counts for new events, and delivery to push gateways (pushers). The rules and their evaluation are pure cores in homeserver/events/."""
