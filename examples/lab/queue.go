package main

import (
	"sync"
	"time"
)

// queue is an in-process queue that delivers at least once, like SQS or any broker with a
// visibility timeout: a received job is hidden for the timeout and becomes visible again
// unless it is acknowledged with the receipt of its latest delivery.
type queue struct {
	mu         sync.Mutex
	visibility time.Duration
	jobs       []*job
}

type job struct {
	id         int
	order      int
	visibleAt  time.Time
	acked      bool
	deliveries int
	receipt    int // the latest delivery's number; an older receipt cannot ack
}

// delivery is one receipt of a job.
type delivery struct {
	jobID   int
	order   int
	receipt int
}

func newQueue(visibility time.Duration) *queue { return &queue{visibility: visibility} }

// enqueue adds a job for order and returns its id.
func (q *queue) enqueue(order int) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	j := &job{id: len(q.jobs) + 1, order: order}
	q.jobs = append(q.jobs, j)
	return j.id
}

// receive hands out the first visible, unacknowledged job and hides it for the visibility
// timeout.
func (q *queue) receive() (delivery, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	now := time.Now()
	for _, j := range q.jobs {
		if j.acked || now.Before(j.visibleAt) {
			continue
		}
		j.deliveries++
		j.receipt = j.deliveries
		j.visibleAt = now.Add(q.visibility)
		return delivery{jobID: j.id, order: j.order, receipt: j.receipt}, true
	}
	return delivery{}, false
}

// receiveWait polls until a job is visible or timeout passes.
func (q *queue) receiveWait(timeout time.Duration) (delivery, bool) {
	deadline := time.Now().Add(timeout)
	for {
		if d, ok := q.receive(); ok {
			return d, true
		}
		if time.Now().After(deadline) {
			return delivery{}, false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// ack acknowledges a delivery; a stale receipt (the job was delivered again since) is
// refused, as brokers refuse an expired receipt handle.
func (q *queue) ack(d delivery) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	j := q.jobs[d.jobID-1]
	if j.receipt != d.receipt {
		return false
	}
	j.acked = true
	return true
}

// requeue makes a delivery visible again after delay (a nack with delay, or River's snooze).
func (q *queue) requeue(d delivery, delay time.Duration) {
	q.mu.Lock()
	defer q.mu.Unlock()
	j := q.jobs[d.jobID-1]
	if j.receipt == d.receipt {
		j.visibleAt = time.Now().Add(delay)
	}
}

// deliveries returns the total number of deliveries of all jobs.
func (q *queue) deliveries() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for _, j := range q.jobs {
		n += j.deliveries
	}
	return n
}

// pending returns the number of unacknowledged jobs.
func (q *queue) pending() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	n := 0
	for _, j := range q.jobs {
		if !j.acked {
			n++
		}
	}
	return n
}
