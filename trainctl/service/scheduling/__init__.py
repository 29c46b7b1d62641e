"""The scheduler's parts (trainctl.service.scheduling.scheduler runs the loop that calls them): the state they share
(`state`), admission of queued jobs (`admission`), handing a job to the runtime (`launching`), following
running jobs (`following`), re-placing a job after a node loss (`replacement`) and re-syncing from the
store (`recovery`)."""
