"""Application services (bridges): registrations, their client-API powers, pushing events to them
and asking them about users and aliases. docs/appservices.md is the operator's page."""
