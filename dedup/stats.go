package dedup

import (
	"context"
	"fmt"
	"time"
)

// ScopeStats counts the keys of one consumer scope (all its tenants).
type ScopeStats struct {
	// Consumer is the scope's consumer name.
	Consumer string
	// CompletedHour and CompletedDay count the keys completed with
	// OutcomeOK in the last hour and the last 24 hours.
	CompletedHour, CompletedDay int64
	// RejectedHour and RejectedDay count the business rejections
	// (OutcomeRejected) completed in the last hour and the last 24 hours.
	RejectedHour, RejectedDay int64
	// InProgress counts the keys whose lease is held and valid.
	InProgress int64
	// OldestLease is how long ago the oldest of those keys was first
	// reserved (0 when none is): a handler that runs, or a key stuck, that long.
	OldestLease time.Duration
	// Expired counts the keys whose lease expired without a release: a
	// worker died or lost it, and the next delivery takes the key over.
	Expired int64
	// Released counts the keys a worker gave up (Release): they wait for
	// their retry, or were dead-lettered.
	Released int64
	// Keys counts every row of the scope.
	Keys int64
}

// Stats counts the keys of each consumer scope, ordered by consumer. It
// reads the whole keys table in one statement (no index covers these
// counts), so call it at an operator's pace, not per message.
func (s *Store) Stats(ctx context.Context) ([]ScopeStats, error) {
	rows, err := s.pool.Query(ctx, s.sql.stats)
	if err != nil {
		return nil, interpretError("key stats", err)
	}
	defer rows.Close()
	var out []ScopeStats
	for rows.Next() {
		var st ScopeStats
		var oldestUS int64
		if err := rows.Scan(&st.Consumer, &st.CompletedHour, &st.CompletedDay, &st.RejectedHour, &st.RejectedDay,
			&st.InProgress, &oldestUS, &st.Expired, &st.Released, &st.Keys); err != nil {
			return nil, fmt.Errorf("key stats: %w", err)
		}
		st.OldestLease = time.Duration(max(oldestUS, 0)) * time.Microsecond
		out = append(out, st)
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("key stats", err)
	}
	return out, nil
}

// statsSQL is the statement of Stats over table t.
func statsSQL(t string) string {
	return `SELECT consumer,
    count(*) FILTER (WHERE outcome = 'ok' AND completed_at >= now() - interval '1 hour'),
    count(*) FILTER (WHERE outcome = 'ok' AND completed_at >= now() - interval '1 day'),
    count(*) FILTER (WHERE outcome = 'rejected' AND completed_at >= now() - interval '1 hour'),
    count(*) FILTER (WHERE outcome = 'rejected' AND completed_at >= now() - interval '1 day'),
    count(*) FILTER (WHERE state = 'in_progress' AND lease_token IS NOT NULL AND locked_until > now()),
    coalesce((extract(epoch FROM now() - min(created_at) FILTER (
        WHERE state = 'in_progress' AND lease_token IS NOT NULL AND locked_until > now())) * 1e6)::bigint, 0),
    count(*) FILTER (WHERE state = 'in_progress' AND lease_token IS NOT NULL AND locked_until <= now()),
    count(*) FILTER (WHERE state = 'in_progress' AND lease_token IS NULL),
    count(*)
FROM ` + t + `
GROUP BY consumer
ORDER BY consumer`
}
