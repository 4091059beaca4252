//go:build !linux

package enginemetrics

import "net"

// sendSys is empty where send uses net.Conn alone.
type sendSys struct{}

func (*sendSys) init(*direct, net.Conn) error { return nil }

// send writes the request; the answer is read by read alone (n is 0).
func (d *direct) send() (n int, err error) {
	_, err = d.conn.Write(d.req)
	return 0, err
}
